"""File, segment and index layer: everything that touches the store directory."""
