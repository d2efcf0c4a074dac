{{/* The chart's name, or nameOverride; at most 63 characters, a label value's limit. */}}
{{- define "matmul-service.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The objects' name: the release name, followed by the chart's unless it holds it already. */}}
{{- define "matmul-service.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "matmul-service.selectorLabels" -}}
app.kubernetes.io/name: {{ include "matmul-service.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "matmul-service.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "matmul-service.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* The Secret holding the API keys: the release's own, or existingSecret. Empty when there are no keys. */}}
{{- define "matmul-service.secretName" -}}
{{- if .Values.apiKeys.existingSecret }}
{{- .Values.apiKeys.existingSecret }}
{{- else if .Values.apiKeys.keys }}
{{- include "matmul-service.fullname" . }}
{{- end }}
{{- end }}

{{/* MATMUL_DEVICES: the ordinals 0 to gpus-1, as the device plugin numbers the container's GPUs. */}}
{{- define "matmul-service.devices" -}}
{{- join "," (until (int .Values.gpus)) }}
{{- end }}

{{/* The port the image's CMD serves on (Dockerfile: EXPOSE 8000). */}}
{{- define "matmul-service.containerPort" -}}
8000
{{- end }}

{{/* The port of the inference protocol over gRPC (Dockerfile: EXPOSE 8001; MATMUL_GRPC_PORT's default). */}}
{{- define "matmul-service.grpcPort" -}}
8001
{{- end }}

{{/* Where CuPy keeps compiled kernels: the image's CUPY_CACHE_DIR (and VOLUME). */}}
{{- define "matmul-service.kernelCachePath" -}}
/var/cache/cupy
{{- end }}

{{/* The autoscaler's threshold: products waiting per pod. */}}
{{- define "matmul-service.targetQueueDepth" -}}
{{- mul .Values.autoscaling.targetQueueDepthPerGpu .Values.gpus }}
{{- end }}

{{/* Products waiting in this release's pods, each pod's queues averaged over a minute (a gauge sampled at each
scrape jumps with every burst), summed. Prometheus labels pod metrics with their namespace and pod, whether it
finds them by annotations or by the ServiceMonitor; a Deployment's pods are named <name>-<hash>-<suffix>. */}}
{{- define "matmul-service.queueDepthQuery" -}}
{{- printf "sum(avg_over_time(matmul_queue_depth{namespace=%q,pod=~%q}[1m]))" .Release.Namespace (printf "%s-[a-z0-9]+-[a-z0-9]+" (include "matmul-service.fullname" .)) }}
{{- end }}
