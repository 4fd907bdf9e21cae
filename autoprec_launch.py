"""The ``autoprec`` console script's first module: a Ctrl-C while the interpreter is still
importing torch and autoprec (a second or more on a busy machine) exits with 130 and no
traceback; :func:`autoprec.cli.run` installs its own handling once it starts."""

import signal
import sys


def main() -> None:
    def _startup_interrupt(signum, frame):
        sys.stderr.write("interrupted while starting; nothing was done\n")
        sys.stderr.flush()
        import os
        os._exit(130)

    signal.signal(signal.SIGINT, _startup_interrupt)
    from autoprec.cli import run

    signal.signal(signal.SIGINT, signal.default_int_handler)
    run()
