"""The node runtime shared by every role: process entry, registration and heartbeat, internal routes
and their protocol, credentials, metrics."""
