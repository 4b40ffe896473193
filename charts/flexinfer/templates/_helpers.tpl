{{/* Chart name. */}}
{{- define "flexinfer.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Resource name prefix: the release name, suffixed with the chart name unless it already contains it. */}}
{{- define "flexinfer.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "flexinfer.controllerName" -}}
{{- printf "%s-controller" (include "flexinfer.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "flexinfer.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "flexinfer.labels" -}}
helm.sh/chart: {{ include "flexinfer.chart" . }}
app.kubernetes.io/name: {{ include "flexinfer.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: flexinfer
{{- end -}}

{{- define "flexinfer.controllerSelectorLabels" -}}
app.kubernetes.io/name: {{ include "flexinfer.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: controller
{{- end -}}

{{- define "flexinfer.controllerLabels" -}}
{{ include "flexinfer.labels" . }}
app.kubernetes.io/component: controller
{{- end -}}

{{- define "flexinfer.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "flexinfer.controllerName" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* `<ref>@<digest>` when a digest is given, else `<ref>`: include "flexinfer.pinned" (list "repo:tag" "sha256:…") */}}
{{- define "flexinfer.pinned" -}}
{{- $ref := index . 0 -}}
{{- $digest := index . 1 | default "" -}}
{{- if $digest -}}{{ printf "%s@%s" $ref $digest }}{{- else -}}{{ $ref }}{{- end -}}
{{- end -}}

{{- define "flexinfer.controllerImage" -}}
{{- include "flexinfer.pinned" (list (printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag)) .Values.image.digest) -}}
{{- end -}}

{{/* Worker image with an optional variant suffix: include "flexinfer.workerImage" (list . "-cuda") */}}
{{- define "flexinfer.workerImage" -}}
{{- $root := index . 0 -}}
{{- $suffix := index . 1 -}}
{{- $ref := printf "%s:%s%s" $root.Values.worker.image.repository (default $root.Chart.AppVersion $root.Values.worker.image.tag) $suffix -}}
{{- include "flexinfer.pinned" (list $ref (index ($root.Values.worker.image.digests | default dict) (trimPrefix "-" $suffix | default "cpu"))) -}}
{{- end -}}

{{/* Alert labels: severity plus alerting.alertLabels. Call with (list . "warning"). */}}
{{- define "flexinfer.alertLabels" -}}
{{- $root := index . 0 -}}
severity: {{ index . 1 }}
{{- range $k, $v := $root.Values.alerting.alertLabels }}
{{ $k }}: {{ $v | quote }}
{{- end }}
{{- end -}}

{{/* flexinfer-proxy, the OpenAI-compatible gateway. */}}
{{- define "flexinfer.proxyName" -}}
{{- printf "%s-proxy" (include "flexinfer.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "flexinfer.proxySelectorLabels" -}}
app.kubernetes.io/name: {{ include "flexinfer.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: proxy
{{- end -}}

{{- define "flexinfer.proxyLabels" -}}
{{ include "flexinfer.labels" . }}
app.kubernetes.io/component: proxy
{{- end -}}

{{- define "flexinfer.proxyServiceAccountName" -}}
{{- if .Values.proxy.serviceAccount.create -}}
{{- default (include "flexinfer.proxyName" .) .Values.proxy.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.proxy.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "flexinfer.proxyImage" -}}
{{- include "flexinfer.pinned" (list (printf "%s:%s" .Values.proxy.image.repository (default .Chart.AppVersion .Values.proxy.image.tag)) .Values.proxy.image.digest) -}}
{{- end -}}

{{/* llama.cpp serving image with an optional flavor suffix: include "flexinfer.llamacppImage" (list . "-rocm") */}}
{{- define "flexinfer.llamacppImage" -}}
{{- $root := index . 0 -}}
{{- $suffix := index . 1 -}}
{{- $ref := printf "%s:%s%s" $root.Values.runtime.llamacpp.repository (default $root.Chart.AppVersion $root.Values.runtime.llamacpp.tag) $suffix -}}
{{- include "flexinfer.pinned" (list $ref (index ($root.Values.runtime.llamacpp.digests | default dict) (trimPrefix "-" $suffix | default "cpu"))) -}}
{{- end -}}
