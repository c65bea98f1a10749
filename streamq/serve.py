"""`streamq serve`: everything on one machine, supervised.

Starts a private redis-server unless REDIS_URL is set, converts the model if needed, then the
workers (one by default), the scheduler and the api replicas (one by default). With several
replicas, nginx listens on the public address in front of them, configured from the template
of docker-compose.yml's load balancer (shared/nginx.py), so one machine runs the compose
topology without Docker. A child that dies is restarted with backoff. Ctrl-C (or SIGTERM) stops
every child and Redis; children also get SIGTERM if this process dies (PDEATHSIG).
"""
from __future__ import annotations

import fcntl
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from shared.model_source import served_name
from shared.nginx import serve_config
from shared.redis_server import RedisServer, default_maxmemory_mb
from shared.settings import ServeSettings
from streamq.stack import Child, cli, prepare_model, wait_ready

log = logging.getLogger("streamq.serve")
NGINX_HINT = ("--api-replicas above 1 runs nginx in front of the replicas, and nginx is not installed. Install it "
              "(Debian/Ubuntu: `sudo apt-get install nginx-light`; `make test` does this when run as root), "
              "or run one replica.")


class _Stop(Exception):
    pass


def _raise_stop(signum, _frame) -> None:
    raise _Stop(signum)


def serve(host: str, port: int, api_replicas: int = 1, workers: int = 1) -> int:
    nginx = find_nginx() if api_replicas > 1 else None
    if api_replicas > 1 and nginx is None:
        log.error(NGINX_HINT)
        return 1
    signal.signal(signal.SIGTERM, _raise_stop)
    signal.signal(signal.SIGINT, _raise_stop)
    settings = ServeSettings()
    redis: RedisServer | None = None
    children: list[Child] = []
    folder = Path(tempfile.mkdtemp(prefix="streamq-serve-"))
    try:
        env = dict(os.environ)
        if not (os.environ.get("REDIS_URL") or os.environ.get("STREAMQ_REDIS_URL")):
            redis = private_redis(settings)
            env["REDIS_URL"] = redis.start()
            log.info("started a private redis-server at %s (maxmemory %s MiB, its files in %s)", env["REDIS_URL"],
                     redis.maxmemory_mb, redis.folder)
        log.info("preparing model %s (the first run converts it; later runs reuse the cache)", settings.model)
        prepare_model(env, quiet=False)
        for name, model in settings.extra_model_list():
            log.info("preparing model %s, served beside it (STREAMQ_EXTRA_MODELS)", model)
            prepare_model(_model_env(env, name, model), quiet=False)
        url = f"http://{_loopback_if_any(host)}:{port}"
        children, ports = _children(env, host, port, api_replicas, workers, nginx, folder)
        children[workers:workers] = [Child(f"worker-{_slug(name or m)}", cli() + ["worker"], _model_env(env, name, m),
                                           with_parent=True) for name, m in settings.extra_model_list()]
        replicas = [f"http://127.0.0.1:{p}" for p in ports] or [url]
        for child in children:
            child.start()
        # Every replica first, then the public address (through nginx when there is one).
        if not _all_ready(replicas + ([url] if api_replicas > 1 else []), children):
            return 1
        _banner(url, served_name(settings), replicas if api_replicas > 1 else [], workers, settings.extra_model_list())
        _supervise(children)
        return 0
    except _Stop:
        log.info("stopping")
        return 0
    except subprocess.CalledProcessError as exc:
        log.error("%s failed (exit code %s)", exc.cmd[-1] if exc.cmd else "a step", exc.returncode)
        return 1
    except RuntimeError as exc:
        log.error("%s", exc)
        return 1
    finally:
        _stop_all(children, redis, folder)


def private_redis(settings: ServeSettings) -> RedisServer:
    """The redis-server `serve` runs when no REDIS_URL is set: its append-only file in the state
    folder (a restart finds the queued requests and results again), its memory capped with
    noeviction (a flood gets 503, and nothing accepted is evicted). A second serve on the same
    folder is refused while the first runs."""
    folder = settings.state_dir / "redis"
    folder.mkdir(parents=True, exist_ok=True)
    lock = os.open(folder / "serve.lock", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(lock)
        raise RuntimeError(f"another `streamq serve` keeps its Redis in {folder}; stop it, or give this one "
                           "another STREAMQ_STATE_DIR (or a REDIS_URL)") from None
    # The lock's descriptor stays open, and the folder held, until this process exits.
    return RedisServer(folder, appendonly=True, own_session=True,
                       maxmemory_mb=settings.redis_maxmemory_mb or default_maxmemory_mb())


def _children(env: dict[str, str], host: str, port: int, api_replicas: int, workers: int, nginx: str | None,
              folder: Path) -> tuple[list[Child], list[int]]:
    """The workers, the scheduler and the api replicas (behind nginx when several), not started yet;
    and the replicas' loopback ports behind nginx (none for one replica, which listens on `port`)."""
    command = cli()
    children = [Child("worker" if workers == 1 else f"worker{i}", command + ["worker"], env, with_parent=True)
                for i in range(workers)]
    children.append(Child("scheduler", command + ["scheduler"], env, with_parent=True))
    if api_replicas == 1:
        children.append(Child("api", command + ["api"], {**env, "STREAMQ_HOST": host, "STREAMQ_PORT": str(port)},
                              with_parent=True))
        return children, []
    ports = _free_ports(api_replicas, avoid=port)
    api_env = {**env, "STREAMQ_HOST": "127.0.0.1", "STREAMQ_AUTH": _replica_auth(env, host),
               "STREAMQ_ALLOWED_HOSTS": _replica_hosts(env, host)}
    children += [Child(f"api{i}", command + ["api"], {**api_env, "STREAMQ_PORT": str(p)}, with_parent=True)
                 for i, p in enumerate(ports)]
    children.append(_nginx_child(nginx, host, port, ports, folder / "nginx", env))
    return children, ports


def _extra_lines(url: str, extra: list[tuple[str | None, str]]) -> str:
    """The banner's lines for the models served beside the main one (STREAMQ_EXTRA_MODELS)."""
    if not extra:
        return ""
    names = [name or served_name(ServeSettings(model=m, served_model_name=None)) for name, m in extra]
    return (f"  Also:    {', '.join(names)}, each on a worker of its own (at {url}/v1/models once loaded):\n"
            f"           curl -s {url}/v1/embeddings -H 'Content-Type: application/json' \\\n"
            f"             -d '{{\"model\": \"{names[0]}\", \"input\": [\"streams\", \"batches\"]}}'\n")


def _model_env(env: dict[str, str], name: str | None, model: str) -> dict[str, str]:
    """A worker's environment for a model served beside the main one: under `name`, else named after
    its source."""
    out = {**env, "STREAMQ_MODEL": model}
    out.pop("STREAMQ_SERVED_MODEL_NAME", None)
    if name:
        out["STREAMQ_SERVED_MODEL_NAME"] = name
    return out


def _slug(model: str) -> str:
    name = Path(model.rstrip("/")).name
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:40]


def _all_ready(addresses: list[str], children: list[Child]) -> bool:
    """Whether each address answers ready, in order, within 600 s in all."""
    deadline = time.monotonic() + 600
    for address in addresses:
        if not wait_ready(address, max(0.0, deadline - time.monotonic()), children):
            log.error("streamq did not become ready at %s; stopping", address)
            return False
    return True


def _stop_all(children: list[Child], redis: RedisServer | None, folder: Path) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    for child in reversed(children):  # nginx first, so no new request reaches a stopping replica
        if child.stop():
            log.warning("%s did not stop in time; killed it", child.name)
    if redis is not None:
        redis.stop()
    shutil.rmtree(folder, ignore_errors=True)
    log.info("all stopped")


def find_nginx() -> str | None:
    # Debian installs nginx in /usr/sbin, which is not on an ordinary user's PATH.
    return shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/usr/local/sbin")


def _nginx_child(binary: str, host: str, port: int, upstream_ports: list[int], folder: Path,
                 env: dict[str, str]) -> Child:
    """nginx in front of the replicas; its config checked with `nginx -t` before anything relies on it."""
    folder.mkdir()
    # Started as root, nginx runs its workers as nobody: they must reach their temp folders in here.
    folder.parent.chmod(0o711)
    folder.chmod(0o755)
    config = folder / "nginx.conf"
    config.write_text(serve_config(host, port, upstream_ports, folder))
    check = subprocess.run([binary, "-t", "-c", str(config)], capture_output=True, text=True)
    if check.returncode != 0:
        raise RuntimeError(f"nginx rejects the generated {config}:\n{check.stderr.strip()}")
    return Child("nginx", [binary, "-c", str(config)], env, with_parent=True)


def _free_ports(count: int, avoid: int) -> list[int]:
    """`count` distinct loopback ports free now (all held at once, so never the same one twice)."""
    while True:
        sockets = [socket.socket() for _ in range(count)]
        try:
            for s in sockets:
                s.bind(("127.0.0.1", 0))
            ports = [s.getsockname()[1] for s in sockets]
        finally:
            for s in sockets:
                s.close()
        if avoid not in ports:
            return ports


def _replica_auth(env: dict[str, str], host: str) -> str:
    """Replicas bind loopback behind nginx, so `auto` is decided for the address nginx listens on."""
    from api.core.auth import auth_enabled  # the api's own rule, not a copy of it

    mode = env.get("STREAMQ_AUTH", "auto")
    if mode != "auto":
        return mode  # on, off, or a typo the api itself reports
    return "on" if auth_enabled(mode, host) else "auto"


def _replica_hosts(env: dict[str, str], host: str) -> str:
    """nginx passes the client's Host on, so `auto` is decided for the address nginx listens on too."""
    from api.core.hosts import is_loopback  # the api's own rule, as above

    setting = env.get("STREAMQ_ALLOWED_HOSTS", "auto")
    return "*" if setting.strip().lower() == "auto" and not is_loopback(host) else setting


def _loopback_if_any(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "::") else host


def _supervise(children: list[Child]) -> None:
    """Restart a child that exits, waiting 1, 2, 4 ... 30 s between tries."""
    while True:
        now = time.monotonic()
        for child in children:
            if child.process is None or child.process.poll() is None:
                continue
            if child.next_start == 0.0:
                if now - child.started_at > 60:
                    child.restarts = 0  # it ran a good while: start over with a short backoff
                delay = min(30.0, 2.0 ** child.restarts)
                log.error("%s exited with code %s; restarting it in %.0f s", child.name,
                          child.process.returncode, delay)
                child.reap()
                child.next_start = now + delay
            elif now >= child.next_start:
                child.restarts += 1
                child.next_start = 0.0
                child.start()
        time.sleep(0.5)


def _banner(url: str, model: str, replicas: list[str], workers: int, extra: list[tuple[str | None, str]] = ()) -> None:
    topology = ""
    if replicas or workers > 1:
        behind = f"{len(replicas)} api replicas behind nginx: {' '.join(replicas)}" if replicas else "1 api replica"
        topology = f"  ({behind}; {workers} worker{'s' if workers > 1 else ''})\n"
    print(f"""
streamq is ready: serving {model} at {url}
{topology}
  Chat:    open {url}/ in a browser (the playground)
  Submit:  curl -s {url}/v1/requests -H 'Content-Type: application/json' \\
             -d '{{"messages": [{{"role": "user", "content": "What is the capital of France?"}}], "temperature": 0, "max_tokens": 32}}'
  Stream:  curl -sN {url}/v1/requests -H 'Content-Type: application/json' \\
             -d '{{"prompt": "Once upon a time", "max_tokens": 48, "stream": true}}'
  Docs:    {url}/docs
{_extra_lines(url, extra)}
Press Ctrl-C to stop.
""", flush=True)
