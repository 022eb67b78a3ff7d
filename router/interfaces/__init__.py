"""The ways in to a control plane: the ``stockade`` CLI, the HTTP API, the MCP server, the local
approval socket, the demo and the console rendering they share. They compose the domain
(`router.control` and what it drives); nothing in the domain imports them."""
