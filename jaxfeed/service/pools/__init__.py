"""Where an elastic pool's workers run: processes on the dispatcher's machine
(`local_backend`), Ray actors (`ray_backend`) or the pods of a Kubernetes
Deployment (`kubernetes_backend`)."""
