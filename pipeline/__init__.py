"""TFX wiring, configuration and command line of dp-fedemb; owns no algorithm."""
