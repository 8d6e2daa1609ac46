"""The code sandbox: hostile answers score 0 within the time limit and the caller keeps running.

Also part of the reliability/security scope (issue 10): these are the limits it relies on.
"""

import json
import os
import time
import uuid

import pytest

from opd.agent.sandbox import SandboxLimits, SandboxResult, _parse_results, run_many, run_tests
from opd.agent.sandbox_process import _drop_to_nobody
from opd.data import Sample
from opd.rewards.code import code_reward

TESTS = "assert add(1, 2) == 3\nassert add(2, 2) == 4\n"
GOOD = "def add(a, b):\n    return a + b\n"
LIMITS = SandboxLimits(timeout_s=3.0, memory_mb=256)


def test_correct_solution_scores_one():
    r = run_tests(GOOD, TESTS, LIMITS)
    assert (r.reward, r.passed, r.total, r.status) == (1.0, 2, 2, "ok")


def test_half_correct_scores_half_with_counts():
    r = run_tests("def add(a, b):\n    return 3\n", TESTS, LIMITS)
    assert (r.reward, r.passed, r.total) == (0.5, 1, 2)
    assert "AssertionError" in r.detail


def test_setup_lines_in_tests_are_not_counted():
    tests = "import math\nX = 2\nassert add(X, X) == 4\nassert math.isclose(add(0.1, 0.2), 0.3)\n"
    r = run_tests(GOOD, tests, LIMITS)
    assert (r.passed, r.total) == (2, 2)


FORGE = ("import os, json\nline = lambda m: (cfg['token'] + ' ' + json.dumps(m) + '\\n').encode()\n"
         "os.write(cfg['result_fd'], line(dict(kind='test', index=0, ok=True)) + line(dict(kind='done', "
         "total=1)))\nos._exit(0)\n")   # no braces: the cases go through str.format

HOSTILE = {
    "infinite loop": "while True:\n    pass\n",
    "fork bomb": "import os\nwhile True:\n    os.fork()\n" + GOOD,
    "subprocess": "import subprocess\nsubprocess.run(['sh', '-c', 'echo hi'])\n" + GOOD,
    "memory hog": "hog = []\nwhile True:\n    hog.append(bytearray(20_000_000))\n" + GOOD,
    "network call": "import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=1)\n" + GOOD,
    "raw socket": "import socket\nsocket.socket()\n" + GOOD,
    "write outside": "open({path!r}, 'w').write('escaped')\n" + GOOD,
    "delete outside": "import os\nos.remove({path!r})\n" + GOOD,
    "kill the parent": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n" + GOOD,
    "hard exit": "import os\nos._exit(0)\n",
    # forging the harness's result lines: its token on the command line (where it used to be),
    # in the collector's objects, in process memory; a process started without an audit event
    "forge from argv": "import sys, json\ncfg = json.loads(sys.argv[1])\n" + FORGE,
    "forge from gc": "import gc\ncfg = next(o for o in gc.get_objects() if isinstance(o, dict) and 'token' in o)\n"
                     + FORGE,
    "read process memory": "open('/proc/self/mem', 'rb')\n" + GOOD,
    "fork_exec": "import _posixsubprocess\n" + GOOD,
    "sleep in a test": GOOD + "import time\ntime.sleep(100)\n",
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_code_scores_zero_within_the_time_limit(name, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("intact")
    code = HOSTILE[name].format(path=str(victim))
    t0 = time.monotonic()
    r = run_tests(code, TESTS, LIMITS)
    elapsed = time.monotonic() - t0
    assert r.reward == 0.0, (name, r)
    assert elapsed < LIMITS.timeout_s + 2.0, (name, elapsed)
    assert victim.read_text() == "intact"           # nothing outside the temp dir changed
    assert os.getpid() > 0 and run_tests(GOOD, TESTS, LIMITS).reward == 1.0   # the caller still works


def _processes_with(marker: str) -> list[int]:
    found = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(int(d))
            except OSError:
                pass
    return found


def test_timeout_kills_the_whole_process_group():
    # allow_subprocess: the child starts a grandchild that would outlive a plain kill of the child
    marker = f"opd-sandbox-grandchild-{uuid.uuid4().hex}"
    code = ("import subprocess, sys, time\n"
            f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', {marker!r}])\n"
            "time.sleep(60)\n")
    r = run_tests(code, "assert True\n", SandboxLimits(timeout_s=2.0, memory_mb=512, allow_subprocess=True))
    assert r.status == "timeout" and r.reward == 0.0
    time.sleep(0.2)
    assert _processes_with(marker) == []


def test_fork_bomb_with_processes_allowed_is_capped_by_rlimit_nproc():
    if os.geteuid() == 0 and not _drop_to_nobody():
        pytest.skip("running as root with a Python installation `nobody` cannot read: the kernel ignores "
                    "RLIMIT_NPROC for root, so only the audit hook (tested above) stops fork bombs here")
    code = "import os\nwhile True:\n    os.fork()\n"
    t0 = time.monotonic()
    r = run_tests(code, TESTS, SandboxLimits(timeout_s=2.0, memory_mb=256, max_processes=16, allow_subprocess=True))
    assert r.reward == 0.0 and time.monotonic() - t0 < 5.0


def test_network_is_unreachable_even_without_the_audit_hook_when_namespaces_work():
    r = run_tests(GOOD, TESTS, LIMITS)
    if not r.isolated_network:
        pytest.skip("network namespaces unavailable here: only the audit hook blocks sockets")
    assert r.isolated_network


def test_run_many_in_parallel_keeps_order():
    jobs = [(GOOD, TESTS), ("while True: pass\n", TESTS), ("def add(a, b):\n    return 3\n", TESTS)]
    t0 = time.monotonic()
    res = run_many(jobs, SandboxLimits(timeout_s=2.0, memory_mb=256), workers=3)
    assert [r.reward for r in res] == [1.0, 0.0, 0.5]
    assert time.monotonic() - t0 < 4.0   # the hang did not serialize the others


def test_installed_libraries_still_import():
    code = "import numpy as np\ndef add(a, b):\n    return int(np.add(a, b))\n"
    assert run_tests(code, TESTS, LIMITS).reward == 1.0


# The solution finds the harness's emit function (and so the token) on its own stack: the
# module docstring says so. Its result lines must still not push the reward past 1.
FORGE_EXTRA = ("import sys\nemit = sys._getframe(1).f_locals['emit']\n"
               "for i in [*range(1000, 1005), -1, 0.5, True, '1']:\n"
               "    emit({'kind': 'test', 'index': i, 'ok': True, 'error': ''})\n"
               "def add(a, b):\n    return a - b\n")


def test_forged_extra_test_lines_cannot_raise_the_reward_above_the_share_passed():
    r = run_tests(FORGE_EXTRA, TESTS, LIMITS)
    # both asserts fail for a - b; the forged lines used to count (reward 4.0)
    assert (r.passed, r.total, r.status, r.reward) == (0, 2, "ok", 0.0)
    assert code_reward(Sample(prompt="add", tests=TESTS), "```python\n" + FORGE_EXTRA + "```") == 0.0


def test_result_lines_count_once_per_index_below_total():
    line = lambda msg: "tok " + json.dumps(msg)   # noqa: E731
    raw = "\n".join([line({"kind": "test", "index": 0, "ok": False, "error": "AssertionError"}),
                     line({"kind": "test", "index": 0, "ok": True}),        # a second line for index 0
                     line({"kind": "test", "index": 1, "ok": "yes"}),       # ok must be the JSON true
                     line({"kind": "test", "index": 2, "ok": True}),        # index >= total
                     line({"kind": "test", "index": None, "ok": True}),     # no index
                     line([1, 2]), "other 3 {}",                            # not a result line
                     line({"kind": "done", "total": "2"}),                  # total must be an int
                     line({"kind": "done", "total": 2})])
    tests, done = _parse_results(raw, "tok")
    assert tests == {0: (False, "AssertionError"), 1: (False, "")}
    assert done == {"kind": "done", "total": 2}
    assert SandboxResult(5, 2, "ok", 0.1).reward == 1.0    # capped even if a count ever got through
