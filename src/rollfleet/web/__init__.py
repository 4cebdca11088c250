"""HTTP plumbing every rollfleet server and client shares: serving helpers, auth, the error shape.

It sits just above ``rollfleet.errors`` and ``rollfleet.model`` so that every layer that speaks
HTTP (the control plane, the gateway, the pool service, their clients) can use one copy.
"""
