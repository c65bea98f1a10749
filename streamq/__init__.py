"""The `streamq` command: its subcommands (cli.py), `streamq serve`, the supervisor of a whole
local deployment (serve.py), and `streamq bench`, the load generator (bench.py). It calls into
api/, worker/ and scheduler/; shared/ is what those three have in common and imports none of them."""
