"""mmis: Kubernetes-native serving of multimodal (image + text) models."""

__version__ = "0.1.0"
