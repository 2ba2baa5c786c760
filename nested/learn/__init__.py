"""What levels are made of: memories, objectives, update rules, optimizers as levels, and the
named memory rules as level recipes (pure declarations)."""
