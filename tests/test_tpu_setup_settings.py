"""tpu_setup's settings files, and tpu_setup/README.md's examples run as written.

Against the fake `gcloud` of tests/_fake_gcloud.py (first on PATH, records its arguments):
inline `# comments` never reach a value, a bad value stops a script with exit code 1 before
any gcloud call, and the README's settings file plus its create-to-delete block give the
exact commands the README promises (a spot queued resource, the run command with
`run.resume=auto`).
"""

import re
import shlex
import subprocess

import pytest

from _fake_gcloud import SETUP, VERBS, Fake, V5E, commands, masked, qr, ssh

README = (SETUP / "README.md").read_text()
SKIP = re.compile(r"<!--\s*doc-test:\s*skip\b")


def readme_blocks():
    """`(body, skipped)` of each ```bash block of tpu_setup/README.md, in order: skipped
    when the line above its fence is a `<!-- doc-test: skip REASON -->` marker."""
    out = []
    for m in re.finditer(r"```bash\n(.*?)```", README, re.S):
        above = README[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        out.append((m.group(1), bool(SKIP.search(above))))
    return out


def env_file_block():
    (body,) = [b for b, _ in readme_blocks() if b.startswith("# rl-v5e.env\n")]
    return body


README_V5E = {"PROJECT": "my-project", "ZONE": "us-west4-a", "TPU_NAME": "rl-v5e"}


def test_readme_env_file_as_written_creates_the_spot_queued_resource(tmp_path):
    f = Fake(tmp_path, {}, states=["ACTIVE"])
    f.env_file.write_text(env_file_block())
    p, calls = f.run("create")
    assert calls == [
        qr("create", README_V5E, "--node-id=rl-v5e", "--accelerator-type=v5litepod-16",
           "--runtime-version=v2-alpha-tpuv5-lite", "--spot"),
        qr("describe", README_V5E, "--format=value(state.state)"),
    ]


def test_readme_blocks_run_as_written_in_dry_run(tmp_path):
    """Every bash block but the settings file and the marked download one runs, with
    `--dry-run` added to `$E`; nothing is called, and the printed commands are right."""
    f = Fake(tmp_path, {})
    (tmp_path / "rl-v5e.env").write_text(env_file_block())
    (tmp_path / "tpu_setup").symlink_to(SETUP)
    blocks = [(b, skip) for b, skip in readme_blocks() if not b.startswith("# rl-v5e.env\n")]
    assert [skip for _, skip in blocks] == [True, False], "one skipped download block, one run"
    body = blocks[1][0]
    assert 'E="--env rl-v5e.env"' in body
    body = body.replace('E="--env rl-v5e.env"', 'E="--env rl-v5e.env --dry-run"')
    p = subprocess.run(["bash", "-euo", "pipefail", "-c", body], cwd=tmp_path, env=f.env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    assert f.calls() == []
    lines = p.stdout.splitlines()
    create = ("gcloud compute tpus queued-resources create rl-v5e --zone=us-west4-a "
              "--project=my-project --node-id=rl-v5e --accelerator-type=v5litepod-16 "
              "--runtime-version=v2-alpha-tpuv5-lite --spot")
    assert lines.count(create) == 2  # `create.sh $E --dry-run`, then `create.sh $E`
    assert not any("tpu-vm create" in ln for ln in lines)
    assert "jax[tpu]==0.10.2" in p.stdout
    assert "JAX_COMPILATION_CACHE_DIR=" in p.stdout and "gs://my-bucket/jax-cache" in p.stdout
    assert "--set run.resume=auto" in p.stdout and "--set run.resume=true" not in p.stdout
    assert "compiled programs" not in p.stdout and "pin what" not in p.stdout
    assert "queued-resources delete rl-v5e" in p.stdout


BAD = [
    ("SPOT=maybe", "SPOT must be one of 1/true/yes/on or 0/false/no/off, got 'maybe'"),
    ("SPOT=1 ; spot please", "SPOT must be one of 1/true/yes/on or 0/false/no/off, got "
                             "'1 ; spot please'"),
    ("RESERVED=2", "RESERVED must be one of 1/true/yes/on or 0/false/no/off, got '2'"),
    ("JAX_VERSION=0.10.2 pinned", "JAX_VERSION must be one word (no spaces), got "
                                  "'0.10.2 pinned'"),
    ("JAX_VERSION=latest", "JAX_VERSION must be a version such as 0.10.2, got 'latest'"),
    ("JAX_CACHE=jax-cache", "JAX_CACHE must be a gs://bucket/path or an absolute path on the "
                            "workers, got 'jax-cache'"),
    ("ACCELERATOR_TYPE=v5litepod-16 16 chips", "ACCELERATOR_TYPE must be one word (no "
                                               "spaces), got 'v5litepod-16 16 chips'"),
    ('ZONE="us-west4-a" us', "text after the closing quote: ' us' (only a '# comment' may "
                             "follow)"),
]


@pytest.mark.parametrize("line, message", BAD, ids=[b[0] for b in BAD])
def test_a_bad_value_stops_the_script_before_any_gcloud_call(tmp_path, line, message):
    f = Fake(tmp_path, {})
    f.env_file.write_text("\n".join([f"{k}={v}" for k, v in V5E.items()] + [line]) + "\n")
    for verb in VERBS if line == "SPOT=maybe" else ("create", "delete", "setup"):
        p, calls = f.run(verb, ok=False)
        assert p.returncode == 1 and calls == [], (verb, p.stderr)
        assert p.stderr.strip().splitlines()[-1] == f"error: {f.env_file}:5: {message}"


def test_a_bad_flag_value_names_the_flag(tmp_path):
    f = Fake(tmp_path, V5E)
    p, calls = f.run("setup", "--jax-version", "0.10 .2", ok=False)
    assert "--jax-version: JAX_VERSION must be one word (no spaces), got '0.10 .2'" in p.stderr
    assert calls == []
    p, calls = f.run("create", "--spot=maybe", ok=False)
    assert "--spot is a switch and takes no value, got '--spot=maybe'" in p.stderr
    assert calls == []


def test_comments_and_quotes_in_settings_files(tmp_path):
    f = Fake(tmp_path, {})
    f.env_file.write_text(
        "\n".join([f"{k}={v}   # {k.lower()}" for k, v in V5E.items()]) + "\n"
        "  # an indented comment line\n"
        "SPOT=yes\t# a tab before the comment\n"
        "JAX_CACHE='/mnt/cache'  # quoted, then a comment\n"
        'COMMAND="echo a # b"  # the quoted # stays, this one goes\n'
        "QUEUED_RESOURCE=qr#1\n")  # a `#` not after whitespace is kept, as in a shell
    _, calls = f.run("launch", "--detach")
    assert masked(calls) == [ssh(V5E)]  # launch alone creates nothing
    (launch,) = commands(calls)
    assert """printf "%s\\n" 'echo a # b' >"$d/cmd"\n""" in launch
    assert "JAX_COMPILATION_CACHE_DIR=" in launch and "/mnt/cache'" in launch
    assert "goes" not in launch and "quoted, then" not in launch
    p, calls = f.run("create", "--dry-run")
    assert shlex.split(p.stdout.splitlines()[0]) == ["gcloud", *qr(
        "create", {**V5E, "TPU_NAME": "qr#1"}, "--node-id=rl-v5e",
        "--accelerator-type=v5litepod-16", "--runtime-version=v2-alpha-tpuv5-lite", "--spot")]
