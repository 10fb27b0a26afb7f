"""Tenant environment packages: an ``environment.yaml`` manifest plus programs and data,
uploaded over REST and run only inside sandboxes (docs/environments.md, "Tenant packages").

``models`` reads and checks the manifest, ``archive`` the uploaded tar.gz, ``service``
stores and finds packages per tenant in object storage, ``routes`` is
``/v1/environments``, ``grader`` runs a package's grade program in a fresh sandbox."""
