"""No orphans: when the test runner that started an agent is killed, the agent dies, and its worker with it.

A stand-in for the test runner (a Python process) starts one ``lightning-emig-run`` node training a tiny run through
:func:`lightning_emig.testing.nodes.start_node`, reports the agent's process id, and is then SIGKILLed: nothing in it
can clean up. The kernel kills the agent (it asked for its parent's death signal), and the worker, which asked for
its agent's, follows.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_emig.testing.commands import descendants, is_alive, kill_tree
from lightning_emig.testing.distributed import free_port
from lightning_emig.testing.nodes import wait_for

RUNNER = """
import json, sys, time
from pathlib import Path
from lightning_emig.testing.nodes import start_node
out = Path(sys.argv[1])
agent = start_node(out, "a", local_addr="127.0.0.2", port=int(sys.argv[2]), run_dir=out / "run", nnodes="1:2",
                   train_args=["data=synthetic", "model=tiny", "trainer.max_steps=100000", "trainer.progress_bar=false"])
(out / "agent.json").write_text(json.dumps({"pid": agent.pid}))
time.sleep(600)
"""


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_killed_test_runner_leaves_no_agent_and_no_worker(tmp_path: Path) -> None:
    runner = subprocess.Popen([sys.executable, "-c", RUNNER, str(tmp_path), str(free_port())], start_new_session=True)
    tree: list[int] = []
    try:
        wait_for(lambda: (tmp_path / "agent.json").exists(), 60, "the runner started no agent")
        agent = json.loads((tmp_path / "agent.json").read_text())["pid"]
        wait_for(lambda: (tmp_path / "run" / "step_times.jsonl").exists(), 120,
                 f"the worker never trained:\n{(tmp_path / 'a.log').read_text()[-3000:]}")
        tree = [agent, *descendants(agent)]
        assert len(tree) >= 2 and all(is_alive(p) for p in tree)
        os.kill(runner.pid, signal.SIGKILL)
        runner.wait(timeout=10)
        wait_for(lambda: not any(is_alive(p) for p in tree), 30,
                 f"left behind after the runner died: {[p for p in tree if is_alive(p)]}")
    finally:
        for pid in [runner.pid, *tree]:
            if is_alive(pid):
                kill_tree(pid)
