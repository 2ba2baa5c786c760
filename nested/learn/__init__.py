"""What levels are made of: memories, objectives and update rules (pure declarations). The
ready-made levels built from them are :mod:`nested.levels`."""
