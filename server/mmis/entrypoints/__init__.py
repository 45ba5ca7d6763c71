"""Command-line entry points (`mmis serve|engine|frontend|tiny-model|wait-frontend`)."""
