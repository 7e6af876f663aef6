"""Process entry points, the shared service runtime, the HTTP bridge, ingress and the CLI."""
