"""Files that start what the advisor chose: a SkyPilot task, Kubernetes Jobs and Deployments, from templates."""
