"""Code shared by the families, under public names; it knows no family."""
