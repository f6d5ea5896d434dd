"""The job's runtime: who this process is (roles, environment), where the job meets (rendezvous,
signing, secrets), what it leaves on disk, and the context every wrapped object shares."""

__all__: list[str] = []
"""Internal: the modules of this package are not public API (the public names are ``fleet.__all__``,
``fleet.nn`` and ``fleet.metrics``); they may change without notice."""
