"""`sdpa view`: the attention of a text (or the textbook passage's U-Net pixels) in the browser.

    sdpa view "How are you?"                 # the bundled all-MiniLM-L6-v2
    sdpa view --file doc.txt --model DIR     # any local transformers model folder
    sdpa view --unet                         # click a pixel, see where it looks
    sdpa view "How are you?" --html out.html # one static file, weights embedded

`add_parser(subparsers)` registers the subcommand on the `sdpa` command's parser;
`python -m sdpa.view` runs it alone.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import webbrowser
from pathlib import Path

MAX_FILE_BYTES = 8 * 2**20  # --file: a document, not a corpus


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register `view` on an argparse subparsers object; returns its parser."""
    view = subparsers.add_parser(
        "view",
        help="an interactive attention viewer in the browser (text or the U-Net pixels)",
        description="Runs the model once on sdpa's attention, then serves a page on "
        "127.0.0.1 that asks for one row of weights per click: any length the model reads.",
    )
    view.add_argument("text", metavar="TEXT", nargs="?", help="the text to look at")
    view.add_argument("--file", help="read the text from this UTF-8 file instead")
    view.add_argument("--model", help="a local transformers model folder (all-MiniLM-L6-v2)")
    view.add_argument(
        "--unet",
        action="store_true",
        help="the textbook U-Net map (1, 128, 64, 64), not a text",
    )
    view.add_argument("--port", type=int, help="port on 127.0.0.1 (a free one)")
    view.add_argument("--no-open", action="store_true", help="do not open a browser")
    view.add_argument("--html", metavar="OUT", help="write one static HTML file instead of serving")
    view.add_argument(
        "--trust-remote-code", action="store_true", help="run Python code the --model folder ships"
    )
    view.set_defaults(run=run, needs=lambda args: () if args.unet else ("hf",))
    return view


def _usage(args: argparse.Namespace) -> str | None:
    """Why these arguments cannot work together, or None."""
    given = [name for name, on in (("TEXT", args.text is not None), ("--file", args.file),
                                   ("--unet", args.unet)) if on]  # fmt: skip
    if len(given) != 1:
        return (
            f"give exactly one of TEXT, --file or --unet, got {', '.join(given) or 'none'} "
            f"(e.g. sdpa view 'How are you?')"
        )
    if args.unet and (args.model or args.trust_remote_code):
        return (
            "--unet shows the textbook U-Net block; --model and --trust-remote-code are for texts"
        )
    if args.html and (args.port is not None or args.no_open):
        return "--html writes a file and starts no server: drop --port and --no-open"
    if args.port is not None and not 0 <= args.port <= 65535:
        return f"--port must be in 0..65535 (0: a free port), got {args.port}"
    if args.html:
        return _html_problem(args.html)
    return None


def _html_problem(path: str) -> str | None:
    """Why --html cannot be written, found before the model runs (nothing is left behind)."""
    if not path.lower().endswith((".html", ".htm")):
        return f"--html must name a .html file, got {path!r}"
    p = Path(path)
    if p.is_dir():
        return f"--html {path!r} is a folder: name a file in it, e.g. {str(p / 'view.html')!r}"
    if not p.resolve().parent.is_dir():
        return f"--html: the folder of {path!r} does not exist"
    try:  # the real test: open it for writing, as the export will
        if p.exists():
            with open(p, "r+b"):  # not truncated: the old file stays until the export
                pass
        else:
            os.close(os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
            p.unlink()
    except OSError as e:
        return f"--html {path!r}: cannot write there: {e.strerror or e}"
    return None


def _read(path: str) -> str:
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--file must be a readable text file, got {path!r}")
    size = p.stat().st_size
    if size > MAX_FILE_BYTES:
        raise ValueError(f"--file {path!r} has {size} bytes; at most {MAX_FILE_BYTES} are read")
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"--file {path!r} is not UTF-8 text: {e}") from e


def run(args: argparse.Namespace) -> int:
    """The `view` subcommand: 0 when served and stopped (Ctrl-C) or written, 2 on bad
    arguments (one line on stderr)."""
    from sdpa.view.connections import listen
    from sdpa.view.session import ViewError

    problem = _usage(args)
    if problem:
        return _fail(problem)
    port, listener = args.port or 0, None
    if not args.html:  # the port is ours before the model runs, and held while it does
        try:
            listener = listen(port)
        except OSError as e:
            return _fail(_port_problem(port, e))
    try:
        session = _session(args)
        if args.html:
            from sdpa.view.export import write_html

            try:
                print(f"wrote {write_html(session, args.html)}")
            except OSError as e:
                return _fail(f"--html {args.html!r}: cannot write there: {e.strerror or e}")
            return 0
    except (ViewError, ImportError, OSError) as e:
        if listener is not None:
            listener.close()
        return _fail(str(e))
    return serve(session, port, open_browser=not args.no_open, listener=listener)


def _port_problem(port: int, e: OSError) -> str:
    return f"--port {port}: cannot listen on 127.0.0.1:{port}: {e.strerror or e}"


def _fail(message: str) -> int:
    print(f"sdpa view: error: {message}", file=sys.stderr)
    return 2


def _session(args: argparse.Namespace):
    from sdpa.view.session import ViewError, text_session, unet_session

    if args.unet:
        print("running the U-Net block on the demo's feature map...", file=sys.stderr)
        session = unet_session()
    else:
        try:
            text = _read(args.file) if args.file else args.text
        except ValueError as e:
            raise ViewError(str(e)) from e
        print(f"running {args.model or 'all-MiniLM-L6-v2'} once...", file=sys.stderr, flush=True)
        session = text_session(text, args.model, trust_remote_code=args.trust_remote_code)
    print(
        f"{session.title}; model run {session.run_seconds:.2f} s (peak "
        f"{session.run_peak_mib:.0f} MiB)",
        file=sys.stderr,
        flush=True,
    )
    return session


def serve(session, port: int = 0, open_browser: bool = True, *, listener=None) -> int:
    """Serve the session on 127.0.0.1 until Ctrl-C (or SIGTERM); prints the URL.
    listener: a socket from connections.listen(port) to serve on (bound earlier)."""
    from sdpa.view.server import ViewServer

    try:
        server = ViewServer(session, port, listener=listener)
    except OSError as e:  # the port is taken, or not ours to bind
        return _fail(_port_problem(port, e))
    print(f"sdpa view: serving {server.url} (Ctrl-C stops)", flush=True)
    if open_browser:
        threading.Thread(target=webbrowser.open, args=(server.url,), daemon=True).start()

    def stop(signum, frame):
        raise KeyboardInterrupt

    main_thread = threading.current_thread() is threading.main_thread()
    if main_thread:
        previous = signal.getsignal(signal.SIGINT), signal.signal(signal.SIGTERM, stop)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        if main_thread:  # a second Ctrl-C must not interrupt the cleanup
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        server.server_close()
        if main_thread:
            signal.signal(signal.SIGINT, previous[0])
            signal.signal(signal.SIGTERM, previous[1])
    print("sdpa view: stopped", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m sdpa.view ...`: the subcommand alone."""
    parser = argparse.ArgumentParser(prog="sdpa")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["view", *(sys.argv[1:] if argv is None else argv)])
    return args.run(args)
