"""Start a real Triton Inference Server on the `neo` model repository (`python -m neo_backend serve`).

Uses the `tritonserver` on PATH when there is one (as in NVIDIA's container), else the one bundled in PyPI
`nvidia-pytriton`, for which it assembles a python-backend directory and the library path. Knob overrides from
`NEO_<KNOB>` environment variables are written into a runtime copy of the model repository, so config.pbtxt stays
the one place the model reads its knobs from. The pieces are public so tests can start servers the same way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import logging
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from ..config import EngineConfig
from ..errors import ConfigError, NeoError

log = logging.getLogger("neo_backend.triton.server")

MODEL_NAME = "neo"
# The checkout's repository (neo_backend is installed editable); NEO_MODEL_REPOSITORY points `serve` elsewhere.
DEFAULT_MODEL_REPOSITORY = Path(__file__).resolve().parents[2] / "model_repository"
EXIT_TIMEOUT_S = 10
KILL_GRACE_S = 20  # past Triton's own exit timeout: it has been seen to hang on exit


class ServerSetupError(NeoError):
    """tritonserver or one of its parts could not be found or prepared."""


@dataclass(frozen=True)
class TritonInstall:
    """Where the tritonserver binary and (for the bundled one) its libraries and python backend live."""

    binary: Path
    bundled_root: Path | None = None  # pytriton/tritonserver when using the nvidia-pytriton wheel

    @property
    def library_dirs(self) -> list[Path]:
        if self.bundled_root is None:
            return []
        site_packages = self.bundled_root.parent.parent
        return [site_packages / "nvidia_pytriton.libs", Path(sysconfig.get_config_var("LIBDIR"))]


@dataclass(frozen=True)
class ServerAddress:
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ServerAddress:
        """NEO_HOST, NEO_HTTP_PORT, NEO_GRPC_PORT, NEO_METRICS_PORT."""
        environ = os.environ if environ is None else environ
        values: dict[str, object] = {}
        for f in dataclasses.fields(cls):
            raw = environ.get("NEO_" + f.name.upper(), "")
            if raw == "":
                continue
            if f.name == "host":
                values[f.name] = raw
            elif raw.isdigit() and 0 < int(raw) < 65536:
                values[f.name] = int(raw)
            else:
                raise ConfigError(f"environment variable NEO_{f.name.upper()}={raw!r} is not a port number (1-65535)")
        return cls(**values)

    def url(self, protocol: str) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        port = {"http": self.http_port, "grpc": self.grpc_port, "metrics": self.metrics_port}[protocol]
        return f"{host}:{port}"


def find_tritonserver() -> TritonInstall:
    on_path = shutil.which("tritonserver")
    if on_path:
        return TritonInstall(Path(on_path))
    # Located, not imported: the wheel is installed without its dependencies, which its __init__ needs.
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise ServerSetupError(
            "no tritonserver on PATH and nvidia-pytriton is not installed; run `make install` "
            "(pip install --no-deps nvidia-pytriton==0.7.0)"
        )
    root = Path(list(spec.submodule_search_locations)[0]).resolve() / "tritonserver"
    binary = root / "bin" / "tritonserver"
    if not binary.is_file():
        raise ServerSetupError(f"nvidia-pytriton is installed but {binary} is missing; reinstall it")
    return TritonInstall(binary, root)


def prepare_backend_dir(install: TritonInstall, cache_dir: Path) -> Path | None:
    """A backend directory holding `python/` with the backend library, its utils and the stub for this Python.

    None for a tritonserver from PATH: it brings its own backends.
    """
    if install.bundled_root is None:
        return None
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    backend = install.bundled_root / "backends" / "python"
    parts = [
        backend / "libtriton_python.so",
        backend / "triton_python_backend_utils.py",
        install.bundled_root / "python_backend_stubs" / version / "triton_python_backend_stub",
    ]
    missing = [str(p) for p in parts if not p.is_file()]
    if missing:
        raise ServerSetupError(f"the bundled python backend lacks {', '.join(missing)} (Python {version} supported?)")
    target = cache_dir / f"backends-py{version}"
    (target / "python").mkdir(parents=True, exist_ok=True)
    for part in parts:
        dest = target / "python" / part.name
        if not dest.exists() or dest.stat().st_size != part.stat().st_size:
            partial = dest.with_name(f"{dest.name}.{os.getpid()}.partial")  # servers may start side by side
            shutil.copy2(part, partial)
            os.replace(partial, dest)
    return target


def server_env(install: TritonInstall) -> dict[str, str]:
    """The server's environment: this interpreter's bin first on PATH (the python-backend stub takes its packages
    from there) and, for the bundled server, its libraries and libpython on LD_LIBRARY_PATH."""
    env = dict(os.environ)
    env["PATH"] = _prepend(str(Path(sys.executable).parent), env.get("PATH"))
    if install.library_dirs:
        env["LD_LIBRARY_PATH"] = _prepend(os.pathsep.join(map(str, install.library_dirs)), env.get("LD_LIBRARY_PATH"))
    return env


def check_stub_environment(install: TritonInstall) -> None:
    """The stub runs an isolated interpreter (no PYTHONPATH, no working directory) of this environment: it must
    find neo_backend in its site-packages, and the bundled stub needs numpy < 2 (with numpy 2 it crashes on the
    first BYTES input)."""
    probe = (
        "import importlib.util, sys\n"
        "if importlib.util.find_spec('neo_backend') is None: sys.exit('neo_backend')\n"
        "import numpy\n"
        "print(numpy.__version__)\n"
    )
    result = subprocess.run(
        [sys.executable, "-I", "-c", probe], cwd="/", capture_output=True, text=True, check=False, timeout=60
    )
    if result.stderr.strip() == "neo_backend":
        raise ServerSetupError(
            f"neo_backend is not installed for {sys.executable}, and the Triton python backend imports "
            f"it from that environment: run `make install` (or `pip install -e .`)"
        )
    if result.returncode != 0:
        raise ServerSetupError(f"{sys.executable} cannot import numpy: {result.stderr.strip()[-500:]}")
    numpy_version = result.stdout.strip()
    if install.bundled_root is not None and int(numpy_version.split(".")[0]) >= 2:
        raise ServerSetupError(
            f"numpy {numpy_version} for {sys.executable}: the bundled Triton python-backend stub needs numpy < 2 "
            f"(pip install 'numpy<2', as `make install` does)"
        )


def read_parameters(config_path: Path) -> dict[str, str]:
    """The `parameters` of a config.pbtxt, as strings."""
    return {key: value.string_value for key, value in _read_config(config_path).parameters.items()}


def knob_overrides(
    repository: Path = DEFAULT_MODEL_REPOSITORY, environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """Knobs that `NEO_<KNOB>` variables change from the repository's config.pbtxt, validated here so a bad value
    fails before the server starts."""
    base = EngineConfig.from_strings(
        read_parameters(repository / MODEL_NAME / "config.pbtxt"), source="config.pbtxt parameter"
    )
    changed = EngineConfig.from_env(environ, base=base).changed_knobs(base)
    return {name: _knob_string(value) for name, value in changed.items()}


def render_model_repository(
    target: Path, overrides: Mapping[str, object] | None = None, source: Path = DEFAULT_MODEL_REPOSITORY
) -> Path:
    """Copy the model repository to `target`, with `overrides` written into the neo model's parameters."""
    overrides = {k: _knob_string(v) for k, v in (overrides or {}).items()}
    unknown = sorted(set(overrides) - set(EngineConfig.field_names()))
    if unknown:
        raise ConfigError(f"unknown knob(s) {', '.join(unknown)}; known: {', '.join(EngineConfig.field_names())}")
    EngineConfig.from_strings(overrides, source="knob")  # fail here, not in the server log
    shutil.copytree(source, target, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
    if overrides:
        from google.protobuf import text_format

        config_path = target / MODEL_NAME / "config.pbtxt"
        config = _read_config(config_path)
        for key, value in overrides.items():
            config.parameters[key].string_value = value
        config_path.write_text(text_format.MessageToString(config))
    return target


def free_ports(count: int) -> list[int]:
    """Local ports free right now (held together while picked, so they differ)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]


def build_command(
    install: TritonInstall,
    repository: Path,
    backend_dir: Path | None,
    address: ServerAddress,
    extra_args: list[str] = (),
) -> list[str]:
    command = [
        str(install.binary),
        f"--model-repository={repository}",
        f"--http-address={address.host}",
        f"--http-port={address.http_port}",
        f"--grpc-address={address.host}",
        f"--grpc-port={address.grpc_port}",
        f"--metrics-address={address.host}",
        f"--metrics-port={address.metrics_port}",
        f"--exit-timeout-secs={EXIT_TIMEOUT_S}",
        "--allow-gpu-metrics=false",
    ]
    if backend_dir is not None:
        # The bundled server has no CUDA: a pinned pool would only log errors.
        command += [f"--backend-directory={backend_dir}", "--pinned-memory-pool-byte-size=0"]
    # Python-backend shared memory regions are named by this prefix: servers running side by side need their own.
    command.append(f"--backend-config=python,shm-region-prefix-name=neo_{address.grpc_port}_{os.getpid()}_")
    return command + list(extra_args)


def launch(
    address: ServerAddress,
    overrides: Mapping[str, object] | None = None,
    *,
    work_dir: Path,
    repository: Path = DEFAULT_MODEL_REPOSITORY,
    stdout: IO | int | None = None,
    extra_args: list[str] = (),
) -> subprocess.Popen:
    """Start tritonserver on a copy of `repository` (rendered into `work_dir`) and return the process.

    The server leads its own process group, shared with its python-backend stubs; stop it with `stop_server`.
    `extra_args` go to tritonserver as they are (TLS, restricted APIs: see the README's security section).
    """
    install = find_tritonserver()
    check_stub_environment(install)
    backend_dir = prepare_backend_dir(install, EngineConfig().cache_path / "triton")
    model_repo = render_model_repository(work_dir / "model_repository", overrides, repository)
    command = build_command(install, model_repo, backend_dir, address, extra_args)
    log.info("starting %s", " ".join(command))
    return subprocess.Popen(
        command,
        env=server_env(install),
        stdout=stdout,
        start_new_session=True,
        stderr=subprocess.STDOUT if stdout is not None else None,
    )


def signal_server(process: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    """Signal the server's whole process group.

    The stub must see SIGTERM too: Triton does not tell a model about shutdown until its in-flight requests are
    done, so the model ends its streams when its own stub gets the signal.
    """
    if process.poll() is None:
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            pass


def stop_server(process: subprocess.Popen, timeout: float = EXIT_TIMEOUT_S + KILL_GRACE_S) -> int:
    """SIGTERM, then SIGKILL if the server outlives `timeout`; returns its exit status.

    Stubs left behind by a server that crashed or was killed (they do not notice, and keep their memory) are
    killed too.
    """
    signal_server(process, signal.SIGTERM)
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        log.error("tritonserver did not exit %.0f s after SIGTERM; killing it", timeout)
        signal_server(process, signal.SIGKILL)
        process.wait(timeout)
    if process.returncode != 0:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass  # no stub left
    return process.returncode


def launch_gateway(
    address: ServerAddress, extra_args: list[str] = (), stdout: IO | int | None = None
) -> subprocess.Popen:
    """Start the OpenAI-compatible gateway (`python -m openai_frontend`) in front of this server's gRPC port.

    It reads where it listens and its API key itself (NEO_OPENAI_HOST, NEO_OPENAI_PORT, NEO_OPENAI_API_KEY).
    """
    command = [sys.executable, "-m", "openai_frontend", "--triton-url", address.url("grpc"), *extra_args]
    return subprocess.Popen(command, stdout=stdout, stderr=subprocess.STDOUT if stdout is not None else None)


def stop_gateway(process: subprocess.Popen) -> int:
    process.terminate()
    try:
        return process.wait(EXIT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait(EXIT_TIMEOUT_S)


def serve() -> int:
    """Run tritonserver, and the OpenAI gateway beside it unless NEO_OPENAI_PORT=off, in the foreground until
    either exits; SIGTERM or SIGINT stops both (see `stop_server`). The ready banner waits for both to answer."""
    address = ServerAddress.from_env()
    repository = Path(os.environ.get("NEO_MODEL_REPOSITORY") or DEFAULT_MODEL_REPOSITORY)
    overrides = knob_overrides(repository)
    with_gateway = os.environ.get("NEO_OPENAI_PORT", "").strip().lower() != "off"
    log.info("model %s, knob overrides: %s", MODEL_NAME, overrides or "none")
    gateway_url = _gateway_url() if with_gateway else None
    stopping = threading.Event()
    previous = {s: signal.signal(s, lambda signum, _frame: stopping.set()) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        with tempfile.TemporaryDirectory(prefix="neo-triton-") as work_dir:
            process = launch(
                address,
                overrides,
                work_dir=Path(work_dir),
                repository=repository,
                extra_args=shlex.split(os.environ.get("NEO_TRITON_ARGS", "")),
            )
            gateway = launch_gateway(address) if with_gateway else None
            announced = False
            while process.poll() is None and (gateway is None or gateway.poll() is None) and not stopping.wait(0.5):
                if not announced and is_ready(address) and (gateway_url is None or _answers(f"{gateway_url}/health")):
                    announced = True
                    for line in ready_banner(address, gateway_url):
                        log.info("%s", line)
            if gateway is not None:
                if gateway.poll() is not None and not stopping.is_set():
                    log.error("the OpenAI gateway exited with %s; stopping tritonserver", gateway.returncode)
                stop_gateway(gateway)
            if stopping.is_set():
                log.info("stopping tritonserver")
            return stop_server(process)  # also for a server that exited on its own: it may have left stubs
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def is_ready(address: ServerAddress, timeout: float = 1.0) -> bool:
    """Whether the server answers HTTP /v2/health/ready with 200 (the model has loaded, profiled and allocated)
    and serves its metrics page, which tritonserver starts a moment after the HTTP service."""
    urls = (f"http://{address.url('http')}/v2/health/ready", f"http://{address.url('metrics')}/metrics")
    return all(_answers(url, timeout) for url in urls)


def _answers(url: str, timeout: float = 1.0) -> bool:
    """Whether a GET of `url` answers 200."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def ready_banner(address: ServerAddress, gateway_url: str | None) -> list[str]:
    """What a user needs once the stack is ready: where each endpoint is and one command to try."""
    lines = [
        f"ready: model {MODEL_NAME!r}",
        f"  Triton gRPC      {address.url('grpc')}",
        f"  Triton HTTP      http://{address.url('http')}/v2/models/{MODEL_NAME}/generate",
        f"  metrics          http://{address.url('metrics')}/metrics",
    ]
    if gateway_url:
        lines.append(f"  OpenAI API       {gateway_url}/v1")
    lines.append(
        f'  try:  {sys.executable} -m client --url {address.url("grpc")} --max-tokens 16 "The capital of France is"'
    )
    if gateway_url:
        lines.append(
            f"  or:   curl -s {gateway_url}/v1/completions -H 'Content-Type: application/json' -d "
            f'\'{{"model": "{MODEL_NAME}", "prompt": "The capital of France is", "max_tokens": 16}}\''
        )
    return lines


def _gateway_url() -> str:
    from openai_frontend.config import GatewayConfig

    return GatewayConfig.from_env().url


def _read_config(config_path: Path):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    try:
        return text_format.Parse(config_path.read_text(), model_config_pb2.ModelConfig())
    except (OSError, text_format.ParseError) as exc:
        raise ServerSetupError(f"cannot read {config_path}: {exc}") from None


def _prepend(entry: str, path: str | None) -> str:
    return os.pathsep.join([entry, path]) if path else entry


def _knob_string(value: object) -> str:
    """A knob value as config.pbtxt writes it ('' for unset)."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
