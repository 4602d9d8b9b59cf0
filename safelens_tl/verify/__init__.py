"""The verifier: tiny offline models and checks of cached against uncached generation."""
