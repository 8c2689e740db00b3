"""The fake `gcloud` of tests/test_tpu_setup.py: a script first on PATH that records its
arguments, answers `describe` with scripted states and, given worker homes, runs each
`ssh --command` with bash in every worker's home; plus the expected-command builders."""

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
SETUP = ROOT / "tpu_setup"
SCRIPTS = sorted(SETUP.glob("*.sh"))
VERBS = ["create", "setup", "stage", "launch", "status", "logs", "stop", "delete"]
REAL_GCLOUD = shutil.which("gcloud")

FAKE_GCLOUD = """#!{python}
import json, os, subprocess, sys
args = sys.argv[1:]
log = os.environ["FAKE_GCLOUD_LOG"]
with open(log, "a") as f:
    f.write(json.dumps(args) + "\\n")
cfg = json.loads(os.environ.get("FAKE_GCLOUD", "{{}}"))
flag = lambda name: next((a.split("=", 1)[1] for a in args if a.startswith(name + "=")), None)
if "describe" in args:
    with open(log) as f:
        n = sum("describe" in json.loads(line) for line in f) - 1
    states = cfg.get("states", ["READY"])
    state = states[min(n, len(states) - 1)]
    if state == "NOT_FOUND":
        sys.exit("ERROR: (gcloud) NOT_FOUND: Resource was not found")
    print(state)
elif "ssh" in args and "homes" in cfg:
    out, rc = flag("--output-directory"), 0
    for i, home in enumerate(cfg["homes"]):
        p = subprocess.run(["bash", "-c", flag("--command")], env={{**os.environ, "HOME": home}},
                           capture_output=True, text=True, timeout=60)
        rc = max(rc, p.returncode)
        if out:
            with open(os.path.join(out, f"{{i}}.log"), "w") as f:
                f.write(p.stdout + p.stderr)
        else:
            sys.stdout.write(p.stdout)
            sys.stderr.write(p.stderr)
    sys.exit(rc)
"""

V5E = {"PROJECT": "rl-proj", "ZONE": "us-west4-a", "TPU_NAME": "rl-v5e",
       "ACCELERATOR_TYPE": "v5litepod-16"}
V4 = {"PROJECT": "rl-proj", "ZONE": "us-central2-b", "TPU_NAME": "rl-v4",
      "ACCELERATOR_TYPE": "v4-8"}


class Fake:
    """A tmp dir with the fake gcloud, an env file and the log of calls."""

    def __init__(self, tmp: pathlib.Path, settings: dict, **cfg):
        self.tmp, self.cfg = tmp, cfg
        bin_dir = tmp / "bin"
        bin_dir.mkdir(exist_ok=True)
        gcloud = bin_dir / "gcloud"
        gcloud.write_text(FAKE_GCLOUD.format(python=sys.executable))
        gcloud.chmod(0o755)
        self.log = tmp / "calls.jsonl"
        self.env_file = tmp / "tpu.env"
        lines = [f"{k}={v}" for k, v in {"POLL_S": 0, **settings}.items()]
        self.env_file.write_text("# test settings\n" + "\n".join(lines) + "\n")
        self.env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}",
                    "FAKE_GCLOUD_LOG": str(self.log), "FAKE_GCLOUD": json.dumps(cfg),
                    "TMPDIR": str(tmp)}
        self.env.pop("RLJAX_TPU_ENV", None)

    def run(self, verb, *args, ok=True):
        self.log.unlink(missing_ok=True)
        p = subprocess.run([str(SETUP / f"{verb}.sh"), "--env", str(self.env_file), *args],
                           cwd=self.tmp, env=self.env, capture_output=True, text=True,
                           timeout=60)
        assert (p.returncode == 0) == ok, f"{verb} rc={p.returncode}\n{p.stdout}\n{p.stderr}"
        return p, self.calls()

    def calls(self):
        if not self.log.exists():
            return []
        return [json.loads(line) for line in self.log.read_text().splitlines()]


def at(s):  # --zone/--project as the scripts pass them
    return [f"--zone={s['ZONE']}", f"--project={s['PROJECT']}"]


def qr(verb, s, *rest):
    return ["compute", "tpus", "queued-resources", verb, s["TPU_NAME"], *at(s), *rest]


def vm(verb, s, *rest):
    return ["compute", "tpus", "tpu-vm", verb, s["TPU_NAME"], *at(s), *rest]


def ssh(s, *rest):
    return vm("ssh", s, "--worker=all", "--command=…", *rest)


def scp(s, src):
    return ["compute", "tpus", "tpu-vm", "scp", src, f"{s['TPU_NAME']}:rljax.tar.gz", *at(s),
            "--worker=all"]


def masked(calls):
    """Calls with the --command text replaced (checked apart), repeated polls collapsed."""
    out = []
    for c in calls:
        c = ["--command=…" if a.startswith("--command=") else a for a in c]
        poll = "describe" in c or any(a.endswith("/.status") for a in c)
        if not (poll and out and out[-1] == c):
            out.append(c)
    return out


def commands(calls):
    return [a.split("=", 1)[1] for c in calls for a in c if a.startswith("--command=")]


def git_repo(tmp):
    repo = tmp / "repo"
    repo.mkdir()
    (repo / "pyproject.toml").write_text("[project]\nname = 'rljax'\n")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(git[:3] + ["init", "-q"], check=True)
    subprocess.run(git + ["add", "."], check=True)
    subprocess.run(git + ["commit", "-q", "-m", "x"], check=True)
    return repo


def workers(tmp, n):
    homes = []
    for i in range(n):
        home = tmp / f"w{i}"
        (home / "rljax-venv" / "bin").mkdir(parents=True)
        (home / "rljax-venv" / "bin" / "activate").write_text("")
        homes.append(str(home))
    return homes


def kill_leftovers(homes):
    for home in homes:
        for pid_file in pathlib.Path(home).glob("rljax-launch/*/pid"):
            try:
                os.killpg(int(pid_file.read_text()), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
