"""Everything that knows about HTTP: routes, dependencies, error handlers, middleware."""
