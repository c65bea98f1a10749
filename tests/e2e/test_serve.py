"""`streamq serve` (what `make run` runs): starts everything, prints working curl, stops cleanly."""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from shared.redis_server import free_port

ROOT = Path(__file__).resolve().parents[2]


def _children(pid: int) -> set[int]:
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.add(int(stat.parent.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _serve(model, cache: Path, watch: dict[str, threading.Event], **settings: str):
    """Start `streamq serve` with its own Redis; each event in `watch` is set when its text is printed."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "STREAMQ_REDIS_URL")}
    env.update(STREAMQ_MODEL=str(model), STREAMQ_DTYPE="float32", STREAMQ_MODEL_CACHE_DIR=str(cache),
               STREAMQ_STATE_DIR=str(cache / "state"), **settings)
    # Its own process group, as a shell gives a foreground job: a Ctrl-C signals the whole group.
    proc = subprocess.Popen([sys.executable, "-m", "streamq.cli", "serve", "--port", str(port)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []

    def read():
        for line in proc.stdout:
            lines.append(line)
            for text, event in watch.items():
                if text in line:
                    event.set()
    threading.Thread(target=read, daemon=True).start()
    return proc, port, lines


def test_serve_starts_everything_prints_curl_and_stops_cleanly(tiny_llama, tmp_path):
    ready = threading.Event()
    proc, port, lines = _serve(tiny_llama, tmp_path, {"Press Ctrl-C to stop": ready})
    try:
        assert ready.wait(180), "".join(lines)
        children = _children(proc.pid)
        assert len(children) == 4, children  # redis-server, worker, scheduler, api
        banner = "".join(lines)
        assert f"http://127.0.0.1:{port}" in banner

        # The banner's submit example works as printed.
        submit = re.search(r"Submit:\s+(curl .*?)\n\s+(-d .*?)\n", banner)
        command = submit.group(1).rstrip("\\ ") + " " + submit.group(2)
        reply = json.loads(subprocess.run(command, shell=True, capture_output=True, text=True, check=True).stdout)
        assert reply["status"] == "queued" and reply["id"]
    finally:
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in the terminal: every process of the group
        proc.wait(60)
    output = "".join(lines)
    assert proc.returncode == 0, output
    assert not [pid for pid in children if _alive(pid)], "orphan processes left"
    # Redis is out of the group: it outlives the workers and is stopped last, so nothing waits for it.
    assert "did not stop" not in output and "redis unavailable" not in output, output
    with socket.socket() as s:  # nothing listens on the port any more (TIME_WAIT leftovers are fine)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen()


def test_serve_restarts_a_worker_that_dies(tiny_llama, tmp_path):
    ready, restarted = threading.Event(), threading.Event()
    proc, port, lines = _serve(tiny_llama, tmp_path, {"Press Ctrl-C to stop": ready,
                                                      "worker exited with code -9; restarting it in": restarted})
    try:
        assert ready.wait(180), "".join(lines)
        workers = [pid for pid in _children(proc.pid)
                   if b"worker" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert len(workers) == 1
        os.kill(workers[0], signal.SIGKILL)
        assert restarted.wait(60), "".join(lines)
        # A new worker comes up, and the service answers again.
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            fresh = [pid for pid in _children(proc.pid)
                     if _alive(pid) and b"worker" in Path(f"/proc/{pid}/cmdline").read_bytes()]
            if fresh and fresh != workers and json.loads(subprocess.run(
                    ["curl", "-s", f"http://127.0.0.1:{port}/readyz"], capture_output=True, text=True).stdout
                    or "{}").get("status") == "ready":
                break
            time.sleep(0.2)  # polling the supervisor's children, not ordering events
        else:
            raise AssertionError("no new worker became ready:\n" + "".join(lines))
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)


def test_serve_runs_an_embedding_model_beside_the_chat_model(tiny_llama, tmp_path):
    from streamq.testing.tiny_encoders import minilm

    ready = threading.Event()
    proc, port, lines = _serve(tiny_llama, tmp_path, {"Press Ctrl-C to stop": ready},
                               STREAMQ_EXTRA_MODELS=f"minilm={minilm()}")
    try:
        assert ready.wait(180), "".join(lines)
        assert len(_children(proc.pid)) == 5  # redis-server, two workers, scheduler, api
        banner = "".join(lines)
        also = re.search(r"Also:.*\n\s+(curl .*?)\n\s+(-d .*?)\n", banner)
        command = also.group(1).rstrip("\\ ") + " " + also.group(2)
        models = f"http://127.0.0.1:{port}/v1/models"
        deadline = time.monotonic() + 120
        while "minilm" not in subprocess.run(["curl", "-s", models], capture_output=True, text=True).stdout:
            assert time.monotonic() < deadline, "".join(lines)
            time.sleep(0.2)  # start-up polling: the second worker loads its model
        reply = json.loads(subprocess.run(command, shell=True, capture_output=True, text=True, check=True).stdout)
        assert [len(d["embedding"]) for d in reply["data"]] == [384, 384] and reply["model"] == "minilm"
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(60)
    assert proc.returncode == 0, "".join(lines)
