"""The dispatcher: REST API, web console, job scheduler and the episode state machine."""
