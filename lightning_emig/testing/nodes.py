"""Simulated nodes on one host: ``lightning-emig-run`` agents on distinct loopback addresses (tests, benchmarks).

Each agent runs in a session of its own with its output in ``<log_dir>/<name>.log``; stop it with
:func:`lightning_emig.testing.commands.kill_tree` (its workers run in sessions of their own too).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

from lightning_emig.launcher.orphans import die_with_parent
from lightning_emig.testing.distributed import free_port

REPO = Path(__file__).resolve().parents[2]


def start_node(
    log_dir: Path, name: str, *, local_addr: str, port: int, run_dir: Path, train_args: Sequence[str],
    nnodes: str = "1:2", rdzv_id: str = "live-train", rdzv_conf: str = "", env: Mapping[str, str] | None = None,
    max_restarts: int = 0, module: str = "lightning_emig.train", run_dir_args: Sequence[str] | None = None,
    rdzv_backend: str = "c10d", rdzv_endpoint: str | None = None, nproc_per_node: int = 1,
    prefix: Sequence[str] = (),
) -> subprocess.Popen:
    """One agent with ``nproc_per_node`` workers running ``python -m lightning_emig.train *train_args`` into
    ``run_dir``.

    ``rdzv_conf`` adds to ``last_call_timeout=2`` (e.g. ``is_host=true`` to pin the rendezvous store to a node).
    ``rdzv_backend="etcd-v2"`` with ``rdzv_endpoint`` (an etcd server's ``host:port``) replaces the c10d store that
    one agent hosts at ``127.0.0.1:port``.
    ``max_restarts`` is torchrun's: a node whose worker failed needs one to rejoin the job.
    ``prefix``: a command the agent runs under (another network namespace: :mod:`lightning_emig.testing.netns`).
    ``module`` replaces ``lightning_emig.train`` (e.g. ``lightning_emig.testing.held_train``); ``run_dir_args``
    tell it the run directory (default ``hydra.run.dir=<run_dir>``; a user's script: ``--out <run_dir>``).
    """
    conf = ",".join(filter(None, ["last_call_timeout=2", rdzv_conf]))
    cmd = [
        *prefix, sys.executable, "-m", "lightning_emig.run", f"--nnodes={nnodes}", f"--nproc-per-node={nproc_per_node}",
        f"--rdzv-backend={rdzv_backend}", f"--rdzv-endpoint={rdzv_endpoint or f'127.0.0.1:{port}'}",
        f"--rdzv-id={rdzv_id}",
        f"--rdzv-conf={conf}", f"--local-addr={local_addr}", f"--max-restarts={max_restarts}",
        "--monitor-interval=0.2", "-m", module, *train_args,
        *(run_dir_args if run_dir_args is not None else [f"hydra.run.dir={run_dir}"]),
    ]
    full_env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    log = open(log_dir / f"{name}.log", "w")  # noqa: SIM115 - the child holds it; closed here right after
    harness = os.getpid()
    # The agent dies with this process (a test runner killed by a timeout leaves no agent, and no worker: they die
    # with their agent).
    proc = subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True, preexec_fn=lambda: die_with_parent(expected_parent=harness))
    log.close()
    return proc


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll ``predicate`` every 0.1 s; TimeoutError(what) after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.1)


def log_tail(log_dir: Path, name: str, chars: int = 6000) -> str:
    path = log_dir / f"{name}.log"
    return path.read_text()[-chars:] if path.exists() else ""


def held_at(log_dir: Path, step: int, agents: Mapping[str, subprocess.Popen], *names: str) -> None:
    """Global rank 0 — on node ``a``, or on one of ``names`` — holds at ``step`` (``LIGHTNING_EMIG_TEST_HOLD_AT_STEPS``
    of :mod:`lightning_emig.testing.held_train`); the agents of those nodes are running."""
    names = names or ("a",)
    running = {n: agents[n] for n in names}
    wait_for(lambda: any(f"test hold: step {step} waits" in log_tail(log_dir, n, 10**6) for n in names)
             or any(p.poll() is not None for p in running.values()),
             180, f"rank 0 never reached step {step}:\n" + "".join(log_tail(log_dir, n) for n in agents))
    assert all(p.poll() is None for p in running.values()), "".join(log_tail(log_dir, n) for n in agents)


def release(hold_dir: Path, step: int) -> None:
    """Let the rank held at ``step`` go on (``hold_dir`` is its ``LIGHTNING_EMIG_TEST_HOLD_DIR``)."""
    (hold_dir / f"release-{step}").touch()



def wait_for_exit(log_dir: Path, agents: Mapping[str, subprocess.Popen], timeout_s: float,
                  names: Iterable[str] | None = None) -> dict[str, int]:
    """Wait for every agent of ``names`` (default: all) to exit; their exit codes. The test fails, with the agent's
    log, when one has not exited within ``timeout_s`` (each in turn)."""
    import pytest

    codes = {}
    for name in agents if names is None else names:
        try:
            codes[name] = agents[name].wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"agent {name} did not finish; its log:\n{log_tail(log_dir, name)}")
    return codes


def assert_agents_succeed(log_dir: Path, agents: Mapping[str, subprocess.Popen], timeout_s: float,
                          names: Iterable[str] | None = None) -> None:
    """:func:`wait_for_exit`, then every one of them exited 0 (else the test fails with its log)."""
    for name, code in wait_for_exit(log_dir, agents, timeout_s, names).items():
        assert code == 0, f"agent {name} failed:\n{log_tail(log_dir, name)}"


def stop_agents(agents: Mapping[str, subprocess.Popen]) -> None:
    """Kill every agent's process tree (its workers run in sessions of their own too) and reap the agent."""
    from lightning_emig.testing.commands import kill_tree

    for proc in agents.values():
        kill_tree(proc.pid)
        proc.wait(timeout=10)

_references: dict[tuple[str, ...], dict[str, float]] = {}
"""Reference losses already computed in this process, by training arguments (the run is deterministic)."""
_started: dict[tuple[str, ...], threading.Thread] = {}
"""Reference runs started in the background by :func:`start_reference`, not yet waited for."""


def start_reference(tmp_path: Path, train_args: Sequence[str]) -> None:
    """Start the uninterrupted run of ``train_args`` in the background, unless it ran already: it trains while the
    elastic run it will be compared with waits on its events, instead of after it. :func:`reference_losses` waits
    for it (and runs it again where it failed, to report why)."""
    key = tuple(train_args)
    if key in _references or key in _started:
        return

    def run() -> None:
        with contextlib.suppress(Exception):
            _references[key] = _run_reference(tmp_path, train_args)

    _started[key] = threading.Thread(target=run, name="reference run", daemon=True)
    _started[key].start()


def reference_losses(tmp_path: Path, train_args: Sequence[str]) -> dict[str, float]:
    """Per-step losses of the same training, uninterrupted, in one process (the yardstick of elastic runs).

    Computed once per set of arguments in a test session: tests of one module compare against the same run."""
    key = tuple(train_args)
    started = _started.pop(key, None)
    if started is not None:
        started.join()
    if key not in _references:
        _references[key] = _run_reference(tmp_path, train_args)
    return _references[key]


def _run_reference(tmp_path: Path, train_args: Sequence[str]) -> dict[str, float]:
    import json

    from lightning_emig.testing.commands import python_module_command, run_command

    run_dir = tmp_path / "reference"
    cmd = python_module_command("lightning_emig.train", *train_args, f"hydra.run.dir={run_dir}")
    # Its store's port is given (free_port: outside the kernel's ephemeral range), not picked by Lightning with
    # bind(0): that pick could take the port a torchrun agent of the run it is compared with has just picked.
    env = {"OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    result = run_command(cmd, timeout_s=900, cwd=REPO, env=env)  # a bound: long runs take minutes
    assert result.returncode == 0, result.stdout[-4000:]
    return json.loads((run_dir / "summary.json").read_text())["step_losses"]


def worst_loss_gap(tmp_path: Path, train_args: Sequence[str], losses: Mapping[str, float],
                   steps: Iterable[str] | None = None) -> float:
    """Largest relative gap between ``losses`` and :func:`reference_losses`, over ``steps`` (default: every step of
    the reference run)."""
    reference = reference_losses(tmp_path, train_args)
    return max(abs(losses[k] - reference[k]) / abs(reference[k]) for k in (reference if steps is None else steps))
