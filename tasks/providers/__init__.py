"""Worker providers: one Protocol (`base.Provider`); the local spot simulator, later EC2 spot."""
