"""Small multi-turn game environments (used to exercise multi-turn rollouts)."""
