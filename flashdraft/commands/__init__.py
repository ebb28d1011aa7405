"""One module per `flashdraft` subcommand; each defines `register(subparsers)`."""
