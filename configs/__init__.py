"""tidal's presets, shipped inside the package as `tidal.presets`: `tidal run tiny` finds tiny.yaml here."""
