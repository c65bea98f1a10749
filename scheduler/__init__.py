"""The scheduler service: periodic jobs run by arq."""
