"""Mistakes a user can make end the process with one paragraph, not a traceback wall.

Only fleet's own user-error types are shortened (a bad strategy value, an inconsistent
launch environment); every other exception keeps Python's full report. Set
FLEET_TRACEBACK=1 to see the traceback of user errors too. torch's own error for a second
``init_process_group`` after the one fleet.init() made gets fleet's explanation after its
report (:mod:`fleet.runtime.default_group`). Every uncaught exception is also this process's last
words (:mod:`fleet.runtime.last_words`), which its peers name when they find it gone.
"""

from __future__ import annotations

import io
import sys

from fleet.runtime import env, last_words

FLEET_TRACEBACK = "FLEET_TRACEBACK"


def _user_error_types() -> tuple[type[BaseException], ...]:
    from fleet.errors import ModelMismatchError, StrategyError, UserProcessGroupError
    from fleet.runtime.env import EnvError

    return (EnvError, StrategyError, ModelMismatchError, UserProcessGroupError)


def install_excepthook() -> None:
    previous = sys.excepthook
    if getattr(previous, "_fleet", False):
        return

    def hook(kind, value, traceback):
        # First, while the process still runs: a peer that finds it gone names this error, not a death.
        last_words.say(value)
        if issubclass(kind, _user_error_types()) and not env.current().has(FLEET_TRACEBACK):
            message = f"fleet: {kind.__name__}: {value}\n(set {FLEET_TRACEBACK}=1 to see the traceback)"
            print(message, file=_unbuffered(sys.stderr), flush=True)
            sys.exit(env.EXIT_USER_ERROR)
        previous(kind, value, traceback)
        from fleet.runtime import default_group  # torch: loaded only once an error got this far

        explanation = default_group.explain_twice(value)
        if explanation is not None:
            print(f"fleet: {explanation}", file=sys.stderr)

    hook._fleet = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def _unbuffered(stream):
    """Where a paragraph printed before exiting is seen. A hook around this one may have put a buffer
    in place of stderr to print what this one prints later (torch.distributed's, installed by every
    ``init_process_group``, prefixes each line with the rank): exiting here would drop it."""
    try:
        stream.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both an OSError and a ValueError
        if isinstance(stream, io.StringIO) and sys.__stderr__ is not None:
            return sys.__stderr__
    return stream
