"""Files: safetensors files streamed to and from tiles (tensorfile), JSON files read with clear errors
(jsonfile)."""
