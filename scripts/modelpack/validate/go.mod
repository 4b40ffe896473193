module flexinfer.local/modelpack-validate

go 1.24

require (
	github.com/modelpack/model-spec v0.0.7
	github.com/opencontainers/go-digest v1.0.0
	github.com/opencontainers/image-spec v1.1.1
)

require github.com/santhosh-tekuri/jsonschema/v5 v5.3.1 // indirect
