// modelpack-validate checks a published artifact against the CNCF ModelPack specification, with the
// specification's own Go module (github.com/modelpack/model-spec, the version go.mod pins):
//
//	modelpack-validate MANIFEST.json CONFIG.json
//
// MANIFEST.json is the manifest as the registry serves it, CONFIG.json the blob its config descriptor
// names. The config goes through the spec's validator (schema.ValidatorMediaTypeModelConfig: its JSON
// schema, config-schema.json) and is decoded strictly into v1.Model; the manifest must carry the spec's
// artifact type and config media type, the config descriptor must match the blob, every layer must use
// one of the spec's layer media types and name its file with org.cncf.model.filepath, and modelfs.diffIds
// must list one digest per layer (a raw layer's DiffID is its digest). Exit 0 when valid; 1 with every
// problem on stderr otherwise.
package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"strings"

	"github.com/modelpack/model-spec/schema"
	v1 "github.com/modelpack/model-spec/specs-go/v1"
	digest "github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

var layerMediaTypes = []string{
	v1.MediaTypeModelWeightRaw, v1.MediaTypeModelWeight, v1.MediaTypeModelWeightGzip, v1.MediaTypeModelWeightZstd,
	v1.MediaTypeModelWeightConfigRaw, v1.MediaTypeModelWeightConfig, v1.MediaTypeModelWeightConfigGzip,
	v1.MediaTypeModelWeightConfigZstd,
	v1.MediaTypeModelDocRaw, v1.MediaTypeModelDoc, v1.MediaTypeModelDocGzip, v1.MediaTypeModelDocZstd,
	v1.MediaTypeModelCodeRaw, v1.MediaTypeModelCode, v1.MediaTypeModelCodeGzip, v1.MediaTypeModelCodeZstd,
	v1.MediaTypeModelDatasetRaw, v1.MediaTypeModelDataset, v1.MediaTypeModelDatasetGzip, v1.MediaTypeModelDatasetZstd,
}

func known(mt string) bool {
	for _, k := range layerMediaTypes {
		if k == mt {
			return true
		}
	}
	return false
}

func main() {
	if len(os.Args) != 3 {
		fmt.Fprintln(os.Stderr, "usage: modelpack-validate MANIFEST.json CONFIG.json")
		os.Exit(2)
	}
	var problems []string
	bad := func(format string, a ...any) { problems = append(problems, fmt.Sprintf(format, a...)) }
	read := func(p string) []byte {
		b, err := os.ReadFile(p)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(2)
		}
		return b
	}
	manifestBytes, configBytes := read(os.Args[1]), read(os.Args[2])

	// The config: the spec's own validator (its JSON schema), then a strict decode into the spec's Go type.
	if err := schema.ValidatorMediaTypeModelConfig.Validate(bytes.NewReader(configBytes)); err != nil {
		bad("config: %v", err)
	}
	var model v1.Model
	dec := json.NewDecoder(bytes.NewReader(configBytes))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&model); err != nil {
		bad("config: does not decode into v1.Model: %v", err)
	}

	var m ocispec.Manifest
	if err := json.Unmarshal(manifestBytes, &m); err != nil {
		bad("manifest: not an OCI manifest: %v", err)
	}
	if m.SchemaVersion != 2 {
		bad("manifest: schemaVersion %d, want 2", m.SchemaVersion)
	}
	if m.MediaType != ocispec.MediaTypeImageManifest {
		bad("manifest: mediaType %q, want %q", m.MediaType, ocispec.MediaTypeImageManifest)
	}
	if m.ArtifactType != v1.ArtifactTypeModelManifest {
		bad("manifest: artifactType %q, want %q", m.ArtifactType, v1.ArtifactTypeModelManifest)
	}
	if m.Config.MediaType != v1.MediaTypeModelConfig {
		bad("manifest: config mediaType %q, want %q", m.Config.MediaType, v1.MediaTypeModelConfig)
	}
	if m.Config.Digest != digest.FromBytes(configBytes) || m.Config.Size != int64(len(configBytes)) {
		bad("manifest: config descriptor %s (%d bytes) does not match the config blob %s (%d bytes)",
			m.Config.Digest, m.Config.Size, digest.FromBytes(configBytes), len(configBytes))
	}
	if len(m.Layers) == 0 {
		bad("manifest: no layers")
	}
	for i, l := range m.Layers {
		if !known(l.MediaType) {
			bad("layer %d (%s): media type %q is not a ModelPack layer type", i, l.Digest, l.MediaType)
		}
		if err := l.Digest.Validate(); err != nil {
			bad("layer %d: digest %q: %v", i, l.Digest, err)
		}
		if p := l.Annotations[v1.AnnotationFilepath]; p == "" {
			bad("layer %d (%s): no %s annotation", i, l.Digest, v1.AnnotationFilepath)
		}
	}
	if model.ModelFS.Type != "layers" {
		bad("config: modelfs.type %q, want \"layers\"", model.ModelFS.Type)
	}
	if len(model.ModelFS.DiffIDs) != len(m.Layers) {
		bad("config: %d diffIds for %d layers", len(model.ModelFS.DiffIDs), len(m.Layers))
	} else {
		for i, l := range m.Layers {
			d := model.ModelFS.DiffIDs[i]
			if err := d.Validate(); err != nil {
				bad("config: diffIds[%d] %q: %v", i, d, err)
			}
			if strings.HasSuffix(l.MediaType, ".raw") && d != l.Digest {
				bad("config: diffIds[%d] %s is not the digest %s of raw layer %d", i, d, l.Digest, i)
			}
		}
	}

	if len(problems) > 0 {
		for _, p := range problems {
			fmt.Fprintln(os.Stderr, p)
		}
		os.Exit(1)
	}
	fmt.Printf("valid ModelPack artifact: %d layers, config %s\n", len(m.Layers), m.Config.Digest)
}
