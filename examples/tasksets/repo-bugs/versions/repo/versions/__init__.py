from versions.compare import newer, parse
