"""Where an elastic pool's workers run: Ray actors (`ray_backend`) or the
pods of a Kubernetes Deployment (`kubernetes_backend`)."""
