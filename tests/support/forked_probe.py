"""`python -m forked_probe CODE`: prints, as one JSON line, what a process sees of how it was
started (tests/cli/test_forked.py runs it exec'd and forked, and compares); exits with CODE.
`python -m forked_probe sleep`: waits to be signalled."""
import json
import os
import sys
import tempfile
import time

if sys.argv[1:] == ["sleep"]:
    print("sleeping", flush=True)
    time.sleep(600)
print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "path0": sys.path[0], "tmp": tempfile.gettempdir(),
                  "probe": os.environ.get("PROBE"), "stdin": sys.stdin.read(), "main": __name__,
                  "ppid": os.getppid(), "own_group": os.getpgid(0) == os.getpid()}))
print("to stderr", file=sys.stderr)
sys.exit(int(sys.argv[1]))
