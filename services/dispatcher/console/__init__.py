"""The web console: server-rendered pages over the same data as the API, served by the
dispatcher under ``/console``. No external assets: it works offline."""
