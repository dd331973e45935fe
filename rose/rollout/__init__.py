"""Elastic rollout scheduler: per-turn routing across dedicated and serving devices."""
