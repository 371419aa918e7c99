"""README.md as a new user pastes it, from the top, on a copy of the checkout: every
command of its ```bash blocks that runs on this machine in about a minute or less runs
for real (the real `geoloco`, `make demo` included), in order, in one folder, and every ```python block runs there
as a script after the commands above it. A command that cannot run here is checked
statically: a `geoloco` line parses with the CLI, a make target exists (the demo's
command parses), a benchmark's flags parse, compose names the services and profiles a
line uses. Every command line of the README has its entry in COMMANDS, so a new one
fails here until it is placed."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from geoloco.cli import build_parser

# The module fixture runs every runnable command (the demo and three more trainings: about
# 6 minutes on 2 idle cores) under the first test's timeout; under `make test`'s parallel
# workers it takes twice that.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

ROOT = Path(__file__).resolve().parents[2]
COMMAND_TIMEOUT_S = 600
README = ROOT / "README.md"
RUN = "run"
# Each command line (its comment dropped, continuations joined) and what happens to it:
# RUN, or why it does not run here (then the static check of its kind applies).
COMMANDS = {
    "make demo": RUN,  # about a minute; the copy's .venv is this suite's, so it only runs
    "make test": "this suite itself",
    "make check": "a part of this suite",
    "make test-stress": "this suite three times",
    "geoloco report runs/demo runs/demo-diloco --label SparseLoCo --label DiLoCo --out runs/report":
        "needs the demo's two runs (8 minutes); test_report_and_progress reports real runs",
    "geoloco local --metrics-port 9400 ...": "a fragment (...)",
    "geoloco local --set monitoring.tensorboard=true ...": "a fragment (...)",
    "docker compose --profile monitoring up ...": "a fragment (...); tests/docker run the profile",
    "geoloco local --workers 4 --rounds 30 --wan 20mbit/50ms/5ms --per-worker-wan "
    "50mbit/20ms,20mbit/50ms,10mbit/80ms,5mbit/120ms": "trains 30 rounds over 5 Mbit/s links (minutes)",
    "geoloco local --method diloco ...": "a fragment (...)",
    "geoloco local --scheme pgc-fr --stragglers 1 --straggler-profiles fixed:4,none,none,none":
        "trains 20 rounds with a 4x straggler (minutes)",
    "geoloco local --help": RUN,
    "geoloco config --reference": RUN,
    "geoloco certs creds --san coord.example.org --san 203.0.113.7 --workers 2": RUN,
    "scp creds/ca.pem creds/token creds/worker-0.pem creds/worker-0.key worker0:creds/":
        "copies to another machine",
    "geoloco coordinator --config run.toml --listen 0.0.0.0:50051 --run-dir runs/exp1 "
    "--tls-cert creds/coordinator.pem --tls-key creds/coordinator.key --tls-ca creds/ca.pem "
    "--token-file creds/token": "serves on every interface for another machine's workers",
    "geoloco worker --coordinator coord.example.org:50051 --tls-ca creds/ca.pem "
    "--tls-cert creds/worker-0.pem --tls-key creds/worker-0.key --token-file creds/token":
        "dials another machine",
    "geoloco local --config examples/tiny_llama/run.toml": RUN,
    "geoloco local --config examples/custom_model/run.toml": RUN,
    "geoloco export runs/tiny-llama runs/tiny-llama-hf": RUN,
    "python -m benchmarks.wan --model hf:examples/llama_20m --tokenizer train:8192":
        "a benchmark of a 20.85M model (many minutes)",
    "make images": "builds the images (tests/docker do it)",
    "GEOLOCO_WORKERS=4 docker compose up --scale worker=4": "tests/docker run the cluster",
    "docker compose logs coordinator": "after the cluster",
    "cat runs/docker/compose/summary.json": "after the cluster",
}


@dataclass
class Block:
    lang: str
    commands: list[str]  # bash: its command lines; python: [the script]


def readme_blocks() -> list[Block]:
    found = re.findall(r"^```(\w+)\n(.*?)^```", README.read_text(), flags=re.S | re.M)
    out = []
    for lang, body in found:
        if lang == "python":
            out.append(Block(lang, [body]))
        elif lang == "bash":
            joined = re.sub(r"\\\n\s*", "", body)
            lines = [re.sub(r"\s+#.*$", "", line).strip() for line in joined.splitlines()]
            out.append(Block(lang, [line for line in lines if line and not line.startswith("#")]))
    return out


def bash_commands() -> list[str]:
    return [c for b in readme_blocks() if b.lang == "bash" for c in b.commands]


@dataclass
class Pasted:
    tree: Path
    outputs: list[tuple[str, subprocess.CompletedProcess]]  # (command or "python block N", result)

    def output(self, name: str) -> str:
        return next(r.stdout for c, r in self.outputs if c == name)


def run_group(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    """``argv`` run to its end in a session of its own, its output captured. On a timeout
    or an interrupt (pytest-timeout's included) the whole session is killed: a local run's
    coordinator and workers too, not only the command that started them."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, **kwargs)
    try:
        out, err = proc.communicate(timeout=COMMAND_TIMEOUT_S)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


@pytest.fixture(scope="module")
def pasted(tmp_path_factory) -> Pasted:
    tree = tmp_path_factory.mktemp("readme") / "checkout"
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, files.decode().split("\0")):
        if (ROOT / name).is_file():
            (tree / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, tree / name)
    venv = Path(sys.executable).parent.parent
    assert (venv / ".installed").is_file(), f"run the suite from `make venv`'s environment, not {venv}"
    (tree / ".venv").symlink_to(venv)  # built: `make demo` goes straight to the run
    env = {k: v for k, v in os.environ.items() if not k.startswith("GEOLOCO_")}
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '/usr/bin:/bin')}"
    env["COLUMNS"] = "80"
    outputs = []
    python_blocks = 0
    for block in readme_blocks():
        if block.lang == "python":
            python_blocks += 1
            script = tree / f"readme_block_{python_blocks}.py"
            script.write_text(block.commands[0])
            name, argv = f"python block {python_blocks}", [sys.executable, str(script)]
            outputs.append((name, run_group(argv, cwd=tree, env=env)))
            continue
        for command in block.commands:
            if COMMANDS.get(command) == RUN:
                outputs.append((command, run_group(["bash", "-c", f"set -euo pipefail\n{command}"],
                                                   cwd=tree, env=env)))
    return Pasted(tree, outputs)


def test_every_readme_command_is_placed() -> None:
    unknown = [c for c in bash_commands() if c not in COMMANDS]
    assert not unknown, f"README commands not in COMMANDS (say whether they run here): {unknown}"
    stale = [c for c in COMMANDS if c not in bash_commands()]
    assert not stale, f"COMMANDS no longer in the README: {stale}"


def test_every_command_and_block_that_can_run_exits_0(pasted: Pasted) -> None:
    ran = [c for c, _ in pasted.outputs]
    assert [c for c in ran if not c.startswith("python block")] == [
        c for c in bash_commands() if COMMANDS[c] == RUN]
    assert sum(c.startswith("python block") for c in ran) == 2
    for command, result in pasted.outputs:
        assert result.returncode == 0, f"{command!r} exited {result.returncode}:\n{result.stderr[-3000:]}"


def test_the_examples_train_and_export_as_the_readme_says(pasted: Pasted) -> None:
    from transformers import AutoModelForCausalLM

    for run in ("demo", "tiny-llama", "custom-model"):
        summary = json.loads((pasted.tree / "runs" / run / "summary.json").read_text())
        assert summary["rounds"] == 20 and summary["digest_mismatches"] == 0, (run, summary)
    assert "round 19/19" in pasted.output("make demo")  # rounds from 0, as the README shows
    model = AutoModelForCausalLM.from_pretrained(pasted.tree / "runs" / "tiny-llama-hf")
    assert model.config.model_type == "llama"
    assert (pasted.tree / "creds" / "worker-1.key").stat().st_mode & 0o777 == 0o600
    assert "--straggler-profiles" in pasted.output("geoloco local --help")
    assert "inner.grad_clip" in pasted.output("geoloco config --reference")


def test_the_api_block_trains_both_runs(pasted: Pasted) -> None:
    first, second = pasted.output("python block 1").splitlines()[-2:]
    ok, loss, checkpoint = first.split(" ")
    assert ok == "True" and float(loss) < 5.0
    assert "tiny-llama-api" in Path(checkpoint).parts
    assert second.startswith("True [0, 0, 0] ")  # the coordinator and each worker ended well
    assert (pasted.tree / "runs" / "my-step" / "summary.json").is_file()


def test_the_codec_block_prints_its_sizes(pasted: Pasted) -> None:
    line = pasted.output("python block 2").strip()
    frame, params, dense = map(int, re.fullmatch(r"(\d+) B a frame for (\d+) parameters; dense bf16 (\d+) B",
                                                  line).groups())
    assert frame * 8 / params < 0.2 and dense > 2 * params  # about 0.16 bits a parameter; bf16


def static_argv(command: str) -> list[str]:
    return [a for a in shlex.split(command) if a != "..."]


def assert_parses(argv: list[str]) -> None:
    try:
        build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse's way of saying a flag or value is wrong
        pytest.fail(f"geoloco {shlex.join(argv)} does not parse (exit {exc.code})")


@pytest.mark.parametrize("command", [c for c, why in COMMANDS.items() if why != RUN])
def test_the_commands_that_cannot_run_here_are_right_statically(command: str) -> None:
    argv = static_argv(command)
    if argv[0] == "geoloco":
        assert_parses(argv[1:])
    elif argv[0] == "make":
        plan = subprocess.run(["make", "-n", "-s", argv[1]], cwd=ROOT, capture_output=True, text=True,
                              check=False)
        assert plan.returncode == 0, plan.stderr
    elif argv[:2] == ["python", "-m"]:
        module = __import__(argv[2], fromlist=["parse_args"])
        module.parse_args(argv[3:])
    elif "docker" in argv:
        compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
        services = compose["services"]
        profiles = {p for s in services.values() for p in s.get("profiles", [])}
        for i, arg in enumerate(argv):
            if arg == "--profile":
                assert argv[i + 1] in profiles
            if arg == "--scale":
                assert argv[i + 1].split("=")[0] in services
        if "logs" in argv:
            assert argv[argv.index("logs") + 1] in services
    else:
        assert argv[0] in ("scp", "cat"), f"no static check for {command!r}"
