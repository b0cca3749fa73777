"""`python tests/support/cli_cases.py < cases.json`: each case, a list of nanoareal flags, through
the CLI's own entry (cli.run(nanoareal.main, argv), what `python nanoareal.py` runs) in this one
process, which imports torch and transformers once instead of once a case. Prints one JSON list:
per case {"code", "stderr", "stdout"}, captured at the file descriptors (C code, warnings and
library handlers included), after {"import": what importing wrote to stderr}. Every warning is
shown each time (a fresh process would show it once, so every case would see it)."""

import json
import os
import sys
import tempfile
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def captured(fn) -> tuple[object, str, str]:
    """fn() with fds 1 and 2 sent to temporary files: (its result, stdout, stderr)."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            result = fn()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
        out.seek(0)
        err.seek(0)
        return result, out.read(), err.read()


def main() -> None:
    cases = json.loads(sys.stdin.read())
    warnings.simplefilter("always")
    modules, _, import_err = captured(lambda: (__import__("cli"), __import__("nanoareal")))
    cli, nanoareal = modules
    results = [{"import": import_err}]
    for argv in cases:
        code, out, err = captured(lambda argv=argv: cli.run(nanoareal.main, argv))
        results.append({"code": code, "stdout": out, "stderr": err})
    print(json.dumps(results))


if __name__ == "__main__":
    main()
