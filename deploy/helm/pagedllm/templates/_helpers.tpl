{{/* Names and labels shared by every template. */}}
{{- define "pagedllm.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "pagedllm.fullname" -}}
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

{{/* The pods' identity: Services, PDB, monitors and the InferencePool select on these. */}}
{{- define "pagedllm.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pagedllm.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "pagedllm.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "pagedllm.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* PromQL label matchers for this release's pods (Prometheus Operator target labels). */}}
{{- define "pagedllm.promSelector" -}}
namespace="{{ .Release.Namespace }}",pod=~"{{ include "pagedllm.fullname" . }}-.*"
{{- end -}}

{{/* At most one autoscaler, and what the InferencePool needs. */}}
{{- define "pagedllm.checks" -}}
{{- if and .Values.autoscaling.keda.enabled .Values.autoscaling.hpa.enabled -}}
{{- fail "autoscaling: enable keda or hpa, not both" -}}
{{- end -}}
{{- if and .Values.inferencePool.enabled (not .Values.gateway.enabled) -}}
{{- fail "inferencePool needs gateway.enabled: the pool routes OpenAI requests to the gateway port" -}}
{{- end -}}
{{- if and .Values.monitoring.podMonitor.enabled .Values.monitoring.serviceMonitor.enabled -}}
{{- fail "monitoring: enable podMonitor or serviceMonitor, not both (each sample would be scraped twice)" -}}
{{- end -}}
{{- end -}}
