"""Command-line glue: settings models, engine arguments, offline generation."""
