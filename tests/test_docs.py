"""The commands the docs show parse, and the cluster job files are well formed.

Every ``bash`` block of ``README.md`` and ``docs/*.md`` is read; each command that runs ``lightning_emig.train``,
one of the worked examples, ``lightning-emig-run`` or ``torchrun`` is checked the way the program itself would
check it: the launcher's arguments by ``lightning-emig-run``'s own check (torchrun's parser and the ``--nnodes``
rule), ``lightning_emig.train``'s overrides by composing the Hydra configuration (an unknown key fails), an
example's flags by its own argument parser. Commands with ``...`` (an abridged command) are skipped. The Slurm
script passes ``bash -n`` and its ``srun`` line, expanded by bash itself, parses; the Kubernetes manifest loads as
YAML and its training container's command parses.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from lightning_emig.testing.nodes import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SLURM = REPO / "docs" / "examples" / "slurm.sbatch"
KUBERNETES = REPO / "docs" / "examples" / "k8s-elastic-job.yaml"
LAUNCHERS = ("lightning-emig-run", "torchrun")


def _commands(text: str) -> Iterator[str]:
    """Each command of each ``bash`` block: continuation lines joined, comments dropped."""
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.DOTALL):
        joined = block.replace("\\\n", " ")
        for line in joined.splitlines():
            command = line.split("  #", 1)[0].strip()
            if command and not command.startswith("#"):
                yield command


def _checked_commands() -> list[tuple[str, str]]:
    found = []
    for path in DOCS:
        for command in _commands(path.read_text()):
            if "..." in command or not re.search(r"lightning_emig\.(train|examples)|lightning-emig-run|torchrun",
                                                 command):
                continue
            found.append((f"{path.relative_to(REPO)}: {command[:60]}", command))
    return found


def check_command(argv: list[str]) -> None:
    """Raise when ``argv`` (a shell command, split) would be refused by the program it runs."""
    program = Path(argv[0]).name
    if program in LAUNCHERS:
        from lightning_emig.run import check_arguments

        check_arguments(argv[1:])
        module_at = argv.index("-m") + 1
        _check_module(argv[module_at], argv[module_at + 1:])
    elif program.startswith("python") and argv[1] == "-m":
        _check_module(argv[2], argv[3:])
    else:
        raise AssertionError(f"not a command these docs run: {argv}")


def _check_module(module: str, args: list[str]) -> None:
    if module in ("lightning_emig.train", "lightning_emig.testing.held_train"):
        _compose([a for a in args if not a.startswith("hydra.")])
    elif module == "lightning_emig.examples.gpt":
        from lightning_emig.examples.gpt import parse_args

        parse_args(args)
    elif module == "lightning_emig.examples.llama_hf":
        from lightning_emig.examples.llama_hf import parse_args

        parse_args(args)
    else:
        raise AssertionError(f"no check for module {module}")


def _compose(overrides: list[str]) -> None:
    from hydra import compose, initialize_config_dir

    from lightning_emig.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        compose("config", overrides=overrides)


@pytest.fixture(autouse=True)
def _endpoint_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LIGHTNING_EMIG_RDZV_ENDPOINT", raising=False)  # check_arguments sets it: keep it test-local


@pytest.mark.parametrize(("where", "command"), _checked_commands(), ids=lambda value: value[:70])
def test_every_command_the_docs_show_parses(where: str, command: str) -> None:
    check_command(shlex.split(command))


def test_the_check_refuses_what_the_programs_refuse() -> None:
    with pytest.raises(SystemExit):
        check_command(shlex.split("lightning-emig-run --nnodes=3:2 -m lightning_emig.train"))
    with pytest.raises(Exception, match="layout.tpx"):
        check_command(shlex.split("python -m lightning_emig.train recipe=tiny_cpu layout.tpx=2"))
    with pytest.raises(SystemExit):
        check_command(shlex.split("python -m lightning_emig.examples.gpt --no-such-flag"))


def test_the_docs_show_commands_to_check() -> None:
    checked = " ".join(command for _, command in _checked_commands())
    for shown in ("lightning-emig-run", "-m lightning_emig.train", "-m lightning_emig.examples.gpt"):
        assert shown in checked


def test_the_slurm_script_is_valid_bash_and_its_launch_parses() -> None:
    subprocess.run(["bash", "-n", str(SLURM)], check=True)
    text = SLURM.read_text().replace("\\\n", " ")
    launch = next(line for line in text.splitlines() if line.startswith("srun "))
    # bash expands the line itself, with the job's variables set and srun and hostname stand-ins.
    script = ("srun() { python3 -c 'import json, sys; print(json.dumps(sys.argv[1:]))' \"$@\"; }\n"
              "hostname() { echo node-1; }\n"
              "VENV=/opt/venv MIN_NODES=2 NPROC_PER_NODE=8 RECIPE=llama_1b ETCD_PORT=2379 ETCD_HOST=node-1 "
              "SLURM_JOB_NUM_NODES=4 SLURM_JOB_ID=1234\n" + launch + "\n")
    argv = json.loads(subprocess.run(["bash", "-c", script], check=True, capture_output=True, text=True).stdout)
    argv = argv[argv.index("--no-kill") + 1:]
    assert argv[0] == "/opt/venv/bin/lightning-emig-run" and "--nnodes=2:4" in argv
    check_command(argv)


def test_the_kubernetes_manifest_has_an_etcd_service_and_a_training_command_that_parses() -> None:
    documents = list(yaml.safe_load_all(KUBERNETES.read_text()))
    kinds = {(d["kind"], d["metadata"]["name"]) for d in documents}
    assert {("Service", "lightning-emig-etcd"), ("Deployment", "lightning-emig-etcd"),
            ("Deployment", "lightning-emig")} <= kinds
    trainer = next(d for d in documents if d["metadata"]["name"] == "lightning-emig")
    pod = trainer["spec"]["template"]["spec"]
    container = pod["containers"][0]
    argv = [*container["command"], *(a.replace("$(POD_IP)", "10.0.0.5") for a in container["args"])]
    check_command(argv)
    grace = next(int(e["value"]) for e in container["env"] if e["name"] == "LIGHTNING_EMIG_GRACE_S")
    assert grace < pod["terminationGracePeriodSeconds"], "the workers' grace must fit in the pod's"
    assert "--rdzv-endpoint=lightning-emig-etcd:2379" in argv
