"""The `ster` subcommands, one module per area. Each module defines register(sub) adding its
subcommands to the argparse subparsers; cli.py discovers every module here, so a new area
adds a file and edits nothing else."""
