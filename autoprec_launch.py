"""The ``autoprec`` console script's first module: a Ctrl-C (or SIGTERM) while the interpreter
is still importing torch and autoprec (a second or more on a busy machine) exits with 130 (143)
and no traceback; :func:`autoprec.cli.run` installs its own handling once it starts."""

import signal
import sys


def main() -> None:
    def _startup_signal(signum, frame):
        sys.stderr.write(f"{'interrupted' if signum == signal.SIGINT else 'terminated'} while "
                         "starting; nothing was done\n")
        sys.stderr.flush()
        import os
        os._exit(128 + signum)

    signal.signal(signal.SIGINT, _startup_signal)
    signal.signal(signal.SIGTERM, _startup_signal)
    from autoprec.cli import run

    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    run()
