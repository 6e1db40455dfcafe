"""`sdpa view`: an interactive attention viewer served on 127.0.0.1.

session.py runs a model once with lazy capture and answers rows and statistics;
server.py serves them to the page in static/, over connections.py (a selector thread and
a bounded pool: the sockets and threads); export.py writes the static file; cli.py is the
`view` subcommand. Top layer: imports the public calls, nothing imports it but the `sdpa`
command.
"""
