"""One module per `dp-fedemb` subcommand; registered in `pipeline.cli.COMMANDS`."""
