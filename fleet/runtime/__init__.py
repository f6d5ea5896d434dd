"""The job's runtime: its environment (``env``: every variable fleet reads), where the job meets
(rendezvous, signing, secrets), what it leaves on disk, and the context every wrapped object shares.
Who this process is lives one package over, in :mod:`fleet.roles`."""

__all__: list[str] = []
"""Internal: the modules of this package are not public API (the public names are ``fleet.__all__``,
``fleet.nn`` and ``fleet.metrics``); they may change without notice."""
